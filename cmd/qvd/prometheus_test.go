package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/qvd/qvd/launch"
)

// metricsURL is the line each rank logs when its endpoint is up (port 0: the port it got).
var metricsURL = regexp.MustCompile(`\[rank (\d+)\].*serving Prometheus metrics.*"metrics_url":\s*"http://([^/"]+)/metrics"`)

// TestPrometheusScrapesLaunch is the end-to-end check of --metrics-addr with a real
// Prometheus server: a 2-rank `qvd launch` with --metrics-addr 127.0.0.1:0 (each rank picks
// a free port and logs it), a prometheus scraping both every second, and its HTTP API
// answering qvd_loss for rank 0 and rank 1, with the collectives' byte counters moving and
// the world size 2. It needs Debian's prometheus package (scripts/setup.sh installs it).
func TestPrometheusScrapesLaunch(t *testing.T) {
	promBin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Skip("no prometheus binary (apt-get install prometheus): skipping the end-to-end scrape test")
	}
	needDataset(t)
	t.Setenv(asQVD, "1") // inherited by the processes launch starts
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var so, se syncBuffer
	done := make(chan int, 1)
	out := t.TempDir()
	go func() {
		// Long enough never to finish by itself: the test stops it once Prometheus answered.
		done <- run(ctx, []string{"launch", "--nproc", "2", "-c", "../../configs/fashion-mlp.yaml", "--out", out,
			"--metrics-addr", "127.0.0.1:0", "--train-subset", "2048", "--test-subset", "200", "--micro-batch", "16",
			"--max-steps", "100000", "--epochs", "1000", "--quiet"}, &so, &se)
	}()
	stop := func() int {
		cancel()
		select {
		case code := <-done:
			return code
		case <-time.After(2 * launch.Grace):
			t.Fatalf("qvd launch did not stop\n%s", tail(se.String(), 30))
			return 0
		}
	}

	// The ranks' addresses, from their logs.
	addrs := map[string]string{}
	for deadline := time.Now().Add(60 * time.Second); len(addrs) < 2; time.Sleep(100 * time.Millisecond) {
		for _, m := range metricsURL.FindAllStringSubmatch(se.String(), -1) {
			addrs[m[1]] = m[2]
		}
		select {
		case code := <-done:
			t.Fatalf("qvd launch exited (%d) before both ranks served metrics\n%s", code, tail(se.String(), 30))
		default:
		}
		if time.Now().After(deadline) {
			stop()
			t.Fatalf("ranks serving metrics: %v, want 0 and 1\n%s", addrs, tail(se.String(), 30))
		}
	}
	t.Logf("ranks serve metrics at %v (%v after the launch)", addrs, time.Since(start).Round(time.Millisecond))

	// Prometheus on loopback, scraping both ranks every second.
	dir := t.TempDir()
	cfg := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
scrape_configs:
  - job_name: qvd
    static_configs:
      - targets: ["%s", "%s"]
`, addrs["0"], addrs["1"])), 0o644); err != nil {
		t.Fatal(err)
	}
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	web := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	prom := exec.Command(promBin, "--config.file", cfg, "--storage.tsdb.path", filepath.Join(dir, "data"),
		"--web.listen-address", web)
	var promOut syncBuffer
	prom.Stdout, prom.Stderr = &promOut, &promOut
	if err := prom.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = prom.Process.Kill()
		_ = prom.Wait()
	}()

	// qvd_loss for both ranks, through Prometheus's query API.
	var loss map[string]float64
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(250 * time.Millisecond) {
		loss, err = promQuery(web, "qvd_loss")
		if err == nil && len(loss) == 2 {
			break
		}
		if time.Now().After(deadline) {
			stop()
			t.Fatalf("Prometheus has qvd_loss for ranks %v (last error: %v), want 0 and 1\nprometheus:\n%s\nqvd:\n%s",
				loss, err, tail(promOut.String(), 20), tail(se.String(), 20))
		}
	}
	t.Logf("qvd_loss by rank, from Prometheus: %v (%v after the launch)", loss, time.Since(start).Round(time.Millisecond))
	for query, check := range map[string]func(float64) bool{
		"qvd_world_size": func(v float64) bool { return v == 2 },
		"qvd_step":       func(v float64) bool { return v >= 1 },
		// Every rank both sends and receives for the gradient's reduction.
		"sum by (rank) (qvd_collective_sent_bytes_total)":     func(v float64) bool { return v > 0 },
		"sum by (rank) (qvd_collective_received_bytes_total)": func(v float64) bool { return v > 0 },
		`qvd_memory_bytes{category="device_params"}`:          func(v float64) bool { return v > 0 },
	} {
		got, err := promQuery(web, query)
		if err != nil {
			t.Errorf("%s: %v", query, err)
			continue
		}
		if len(got) != 2 {
			t.Errorf("%s: values for ranks %v, want 0 and 1", query, got)
		}
		for rank, v := range got {
			if !check(v) {
				t.Errorf("%s on rank %s = %g", query, rank, v)
			}
		}
	}
	if code := stop(); code != exitInterrupted && code != exitOK {
		t.Fatalf("qvd launch exit %d after the stop\n%s", code, tail(se.String(), 30))
	}
	t.Logf("took %v", time.Since(start).Round(time.Millisecond))
}

// promQuery runs an instant query on the Prometheus at web and returns each series' value
// by its rank label.
func promQuery(web, query string) (map[string]float64, error) {
	resp, err := http.Get("http://" + web + "/api/v1/query?query=" + url.QueryEscape(query))
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			Result []struct {
				Metric map[string]string `json:"metric"`
				Value  [2]any            `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &r); err != nil {
		return nil, fmt.Errorf("%s: %w (%s)", query, err, body)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("%s: %s %s", query, r.Status, r.Error)
	}
	got := map[string]float64{}
	for _, s := range r.Data.Result {
		text, _ := s.Value[1].(string)
		v, err := strconv.ParseFloat(text, 64)
		if err != nil {
			return nil, fmt.Errorf("%s: value %v: %w", query, s.Value[1], err)
		}
		got[s.Metric["rank"]] = v
	}
	return got, nil
}
