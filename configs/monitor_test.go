package configs

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/monitor"
)

// TestMonitorDefaults: TensorBoard on in <run.out>/tb, CSV off (its directory resolved all
// the same, for when a flag or file turns it on).
func TestMonitorDefaults(t *testing.T) {
	c := Default()
	c.Resolve()
	want := monitor.Config{
		TensorBoard: monitor.Target{Enabled: true, Dir: filepath.Join("runs", "qvd", "tb")},
		CSV:         monitor.Target{Dir: filepath.Join("runs", "qvd", "csv")},
	}
	if got := c.Monitors(); got != want {
		t.Errorf("defaults %+v, want %+v", got, want)
	}
	c, err := Parse([]byte("tensorboard:\n  enabled: false\ncsv_monitor:\n  enabled: true\n  dir: /data/csv\n"), "test")
	if err != nil {
		t.Fatal(err)
	}
	c.Resolve()
	want = monitor.Config{
		TensorBoard: monitor.Target{Dir: filepath.Join("runs", "qvd", "tb")},
		CSV:         monitor.Target{Enabled: true, Dir: "/data/csv"},
	}
	if got := c.Monitors(); got != want {
		t.Errorf("from YAML %+v, want %+v", got, want)
	}
	if _, err := Parse([]byte("tensorboard:\n  enable: true\n"), "test"); err == nil || !strings.Contains(err.Error(), "tensorboard.enable") {
		t.Errorf("misspelt key: %v", err)
	}
}

// TestDeepSpeedMonitors: tensorboard and csv_monitor do what DeepSpeed does (files under
// output_path/job_name; a section without enabled: true is off) instead of a warning.
func TestDeepSpeedMonitors(t *testing.T) {
	for _, c := range []struct {
		json    string
		want    monitor.Config
		wantErr string
	}{
		{json: `{"tensorboard": {"enabled": true, "output_path": "/logs/tb", "job_name": "bert"}, "csv_monitor": {"enabled": true}}`,
			want: monitor.Config{TensorBoard: monitor.Target{Enabled: true, Dir: "/logs/tb/bert"}, CSV: monitor.Target{Enabled: true, Dir: "DeepSpeedJobName"}}},
		{json: `{"tensorboard": {"output_path": "x/"}, "csv_monitor": {"enabled": false}}`,
			want: monitor.Config{}},
		{json: `{"csv_monitor": {"enabled": true, "output_path": "out", "job_name": "/abs/job"}}`,
			want: monitor.Config{TensorBoard: monitor.Target{Enabled: true}, CSV: monitor.Target{Enabled: true, Dir: "/abs/job"}}},
		{json: `{"tensorboard": {"enabled": true, "flush_secs": 5}}`, wantErr: "tensorboard.flush_secs: not supported"},
		{json: `{"csv_monitor": {"enabled": true, "job_name": 3}}`, wantErr: "csv_monitor.job_name: want a string"},
		{json: `{"tensorboard": true}`, wantErr: "tensorboard: want a JSON object"},
	} {
		cfg := Default()
		res, err := ApplyDeepSpeed(&cfg, []byte(c.json))
		if c.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), c.wantErr) {
				t.Errorf("%s: error %v, want %q", c.json, err, c.wantErr)
			}
			continue
		}
		if err != nil || len(res.Warnings) != 0 {
			t.Errorf("%s: %v, warnings %q", c.json, err, res.Warnings)
			continue
		}
		if got := cfg.Monitors(); got != c.want {
			t.Errorf("%s: %+v, want %+v", c.json, got, c.want)
		}
	}
}
