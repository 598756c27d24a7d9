package monitor

import (
	"math"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/tbevents"
)

func sc(tag string, v float64) tbevents.Scalar { return tbevents.Scalar{Tag: tag, Value: v} }

func TestScalars(t *testing.T) {
	for _, c := range []struct {
		name string
		r    metrics.Record
		want []tbevents.Scalar
	}{
		{"train, every figure", metrics.Record{Kind: metrics.KindTrain, Step: 3, Loss: 0.5, LR: 1e-3, SamplesPerSec: 900, GradNorm: 2, Scale: 65536,
			RSSBytes: 1 << 30, HeapBytes: 1 << 20, Memory: map[string]int64{"device_params": 100, "host_optimizer": 300}},
			[]tbevents.Scalar{sc(TagTrainLoss, 0.5), sc(TagLR, 1e-3), sc(TagSamplesPerSec, 900), sc(TagGradNorm, 2), sc(TagLossScale, 65536),
				sc(TagRSS, 1<<30), sc(TagHeap, 1<<20), sc(TagModelStates, 400)}},
		{"train, warm-up start", metrics.Record{Kind: metrics.KindTrain, Step: 1, Loss: 2.3},
			[]tbevents.Scalar{sc(TagTrainLoss, 2.3), sc(TagLR, 0)}},
		{"eval", metrics.Record{Kind: metrics.KindEval, Step: 10, Loss: 0.4, Accuracy: 0.875, Samples: 1000},
			[]tbevents.Scalar{sc(TagEvalLoss, 0.4), sc(TagEvalAccuracy, 0.875)}},
		{"val", metrics.Record{Kind: metrics.KindVal, Step: 10, Loss: 0.5, Accuracy: 0.75, Samples: 600},
			[]tbevents.Scalar{sc(TagValLoss, 0.5), sc(TagValAccuracy, 0.75)}},
		{"unknown kind", metrics.Record{Kind: "other", Loss: 1}, nil},
	} {
		if got := Scalars(nil, &c.r); !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: %v, want %v", c.name, got, c.want)
		}
	}
}

func TestAppendValue(t *testing.T) {
	for _, c := range []struct {
		v    float64
		want string
	}{
		{0, "0"}, {0.5, "0.5"}, {-2.25, "-2.25"}, {1e-4, "0.0001"}, {1e-5, "1e-05"}, {123456789, "123456789"},
		{1e16, "1e+16"}, {0.30000000000000004, "0.30000000000000004"}, {math.NaN(), "nan"}, {math.Inf(1), "inf"}, {math.Inf(-1), "-inf"},
	} {
		if got := string(appendValue(nil, c.v)); got != c.want {
			t.Errorf("appendValue(%v) = %q, want %q (Python's repr)", c.v, got, c.want)
		}
	}
}

func readString(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// TestCSVLayout: DeepSpeed's file names and headers; a fresh run truncates, a resumed one
// appends without a second header.
func TestCSVLayout(t *testing.T) {
	dir := t.TempDir()
	write := func(appendToExisting bool, step int64, s ...tbevents.Scalar) {
		t.Helper()
		c, err := CreateCSV(dir, appendToExisting, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := c.Write(step, s); err != nil {
			t.Fatal(err)
		}
		if err := c.Close(); err != nil || c.Close() != nil {
			t.Fatal(err)
		}
		if err := c.Write(step, s); err == nil {
			t.Error("write after Close succeeded")
		}
	}
	write(false, 1, tbevents.Scalar{Tag: "train/loss", Value: 2.5}, tbevents.Scalar{Tag: "Train/Samples/lr", Value: 1e-5}, tbevents.Scalar{Tag: "my metric", Value: 3})
	write(true, 2, tbevents.Scalar{Tag: "train/loss", Value: 1.25})
	if got, want := readString(t, filepath.Join(dir, "train_loss.csv")), "step,loss\n1,2.5\n2,1.25\n"; got != want {
		t.Errorf("train_loss.csv = %q, want %q", got, want)
	}
	if got, want := readString(t, filepath.Join(dir, "Train_Samples_lr.csv")), "step,lr\n1,1e-05\n"; got != want {
		t.Errorf("Train_Samples_lr.csv = %q, want %q", got, want)
	}
	if got, want := readString(t, filepath.Join(dir, "my_metric.csv")), "step,my metric\n1,3\n"; got != want {
		t.Errorf("my_metric.csv = %q, want %q", got, want)
	}
	write(false, 1, tbevents.Scalar{Tag: "train/loss", Value: 7})
	if got, want := readString(t, filepath.Join(dir, "train_loss.csv")), "step,loss\n1,7\n"; got != want {
		t.Errorf("after a fresh run: %q, want %q", got, want)
	}
}

// TestSink writes a short run, resumes it and starts it afresh, reading the event files and
// CSV files back.
func TestSink(t *testing.T) {
	run := t.TempDir()
	cfg := DefaultConfig()
	cfg.CSV.Enabled = true
	cfg.Resolve(run)
	if cfg.TensorBoard.Dir != filepath.Join(run, "tb") || cfg.CSV.Dir != filepath.Join(run, "csv") {
		t.Fatalf("resolved %+v", cfg)
	}
	now := time.Unix(1700000000, 0)
	clk := func() time.Time { return now }
	records := []metrics.Record{
		{Kind: metrics.KindTrain, Time: 1700000000.5, Step: 1, Loss: 2, LR: 0.1, SamplesPerSec: 100, RSSBytes: 5 << 20},
		{Kind: metrics.KindTrain, Time: 1700000001, Step: 2, Loss: 1, LR: 0.1, SamplesPerSec: 120, RSSBytes: 5 << 20},
		{Kind: metrics.KindEval, Time: 1700000002, Step: 2, Loss: 1.5, Accuracy: 0.5},
	}
	s, err := Open(cfg, Options{Hostname: "host", Now: clk})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range records {
		if err := s.Write(r); err != nil {
			t.Fatal(err)
		}
	}
	first := s.TensorBoardPath()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	events, err := tbevents.ReadFile(first)
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != 4 || events[0].FileVersion != tbevents.FileVersion {
		t.Fatalf("events %+v", events)
	}
	for i, r := range records {
		e := events[1+i]
		want := Scalars(nil, &r)
		for j := range want {
			want[j].Value = float64(float32(want[j].Value)) // simple_value is a float
		}
		if e.Step != r.Step || e.WallTime != r.Time || !reflect.DeepEqual(e.Scalars, want) {
			t.Errorf("event %d = %+v, want step %d time %v %v", 1+i, e, r.Step, r.Time, want)
		}
	}
	if got, want := readString(t, filepath.Join(cfg.CSV.Dir, "eval_accuracy.csv")), "step,accuracy\n2,0.5\n"; got != want {
		t.Errorf("eval_accuracy.csv = %q, want %q", got, want)
	}

	// Resumed from step 1: a second file, starting with a SessionLog START at step 2.
	now = now.Add(time.Minute)
	s, err = Open(cfg, Options{Resume: true, Hostname: "host", Now: clk})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Write(records[1]); err != nil {
		t.Fatal(err)
	}
	second := s.TensorBoardPath()
	s.Close()
	events, err = tbevents.ReadFile(second)
	if err != nil {
		t.Fatal(err)
	}
	if second == first || len(events) != 3 || !events[1].SessionStart || events[1].Step != 2 || events[2].Step != 2 {
		t.Errorf("resumed file %s: %+v", second, events)
	}
	if _, err := os.Stat(first); err != nil {
		t.Errorf("resuming removed the first file: %v", err)
	}
	if got, want := readString(t, filepath.Join(cfg.CSV.Dir, "train_loss.csv")), "step,loss\n1,2\n2,1\n2,1\n"; got != want {
		t.Errorf("train_loss.csv after resume = %q, want %q", got, want)
	}

	// A fresh run replaces both files.
	s, err = Open(cfg, Options{Hostname: "host", Now: clk})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	left, _ := filepath.Glob(filepath.Join(cfg.TensorBoard.Dir, tbevents.FilePrefix+"*"))
	if len(left) != 1 || left[0] != s.TensorBoardPath() {
		t.Errorf("event files after a fresh start: %v", left)
	}
	// The step path allocates nothing.
	if n := testing.AllocsPerRun(100, func() { s.Write(records[0]) }); n != 0 {
		t.Errorf("Sink.Write: %v allocations", n)
	}
}

func TestSinkOff(t *testing.T) {
	s, err := Open(Config{}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Write(metrics.Record{Kind: metrics.KindTrain, Step: 1}); err != nil || s.TensorBoardPath() != "" || s.Close() != nil {
		t.Errorf("a sink with nothing enabled: %v", err)
	}
}
