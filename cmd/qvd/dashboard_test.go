package main

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/internal/metrics"
)

// TestDashboardServesRealRun: `qvd dashboard RUN_DIR` serves the records a real (tiny)
// training run wrote, as the trainer writes them, on the URL it prints, and exits 0 when its
// context is cancelled (Ctrl-C).
func TestDashboardServesRealRun(t *testing.T) {
	needDataset(t)
	dir := t.TempDir()
	if code, stdout, stderr := runQVD(t, "train", "--max-steps", "30", "--train-subset", "512",
		"--test-subset", "200", "--out", dir, "--quiet"); code != exitOK {
		t.Fatalf("train: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	out, errb := &syncBuffer{}, &syncBuffer{}
	done := make(chan int, 1)
	go func() { done <- run(ctx, []string{"dashboard", dir, "--addr", "127.0.0.1:0"}, out, errb) }()

	urlRE := regexp.MustCompile(`http://127\.0\.0\.1:\d+/`)
	var url string
	for deadline := time.Now().Add(10 * time.Second); url == ""; time.Sleep(10 * time.Millisecond) {
		select {
		case code := <-done:
			t.Fatalf("dashboard exited %d before serving\nstdout:\n%s\nstderr:\n%s", code, out, errb)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no URL printed in 10 s\nstdout:\n%s\nstderr:\n%s", out, errb)
		}
		url = urlRE.FindString(out.String())
	}

	client := &http.Client{Timeout: 5 * time.Second}
	res, err := client.Get(url + "api/metrics?since=0")
	if err != nil {
		t.Fatal(err)
	}
	var resp dashboard.Response
	err = json.NewDecoder(res.Body).Decode(&resp)
	res.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	var train, eval int
	for _, r := range resp.Records {
		switch r.Kind {
		case metrics.KindTrain:
			train++
		case metrics.KindEval:
			eval++
		}
	}
	last := resp.Records[len(resp.Records)-1]
	if train != 30 || eval == 0 || resp.Next != len(resp.Records) || resp.Title != filepath.Base(dir) {
		t.Fatalf("%d train and %d eval records, next %d, title %q; want 30, >0, %d, %q", train, eval, resp.Next, resp.Title, len(resp.Records), filepath.Base(dir))
	}
	var withMemory bool
	for _, r := range resp.Records {
		withMemory = withMemory || (r.Kind == metrics.KindTrain && r.Memory["device_params"] > 0 && r.RSSBytes > 0)
	}
	if !withMemory || last.Kind != metrics.KindEval || last.Accuracy <= 0 {
		t.Fatalf("no train record with memory and RSS (%v), or the last record is not the final eval: %+v", withMemory, last)
	}

	res, err = client.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(res.Body)
	res.Body.Close()
	if res.StatusCode != http.StatusOK || !strings.Contains(string(page), `id="loss"`) {
		t.Fatalf("GET %s: %d, page without the loss chart", url, res.StatusCode)
	}

	cancel()
	select {
	case code := <-done:
		if code != exitOK {
			t.Fatalf("dashboard exited %d after cancel, want 0\nstderr:\n%s", code, errb)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("dashboard did not stop within 5 s of cancel")
	}
}

// TestDashboardUsage: a missing run directory argument is a usage error.
func TestDashboardUsage(t *testing.T) {
	code, stdout, stderr := runQVD(t, "dashboard")
	if code != exitUsage || stdout != "" || !strings.Contains(stderr, "missing argument") {
		t.Fatalf("exit %d, stdout %q, stderr %q; want exit 2 and missing argument", code, stdout, stderr)
	}
}

// TestDashboardTrainFlag: `qvd train --dashboard-addr` serves the page while it trains and
// logs its URL; an address that is not HOST:PORT is a configuration error naming the key.
func TestDashboardTrainFlag(t *testing.T) {
	needDataset(t)
	dir := t.TempDir()
	code, stdout, stderr := runQVD(t, "train", "--max-steps", "5", "--train-subset", "256", "--test-subset", "100",
		"--out", dir, "--quiet", "--dashboard-addr", "127.0.0.1:0")
	if code != exitOK {
		t.Fatalf("train: exit %d\nstdout:\n%s\nstderr:\n%s", code, stdout, stderr)
	}
	log, err := os.ReadFile(filepath.Join(dir, "train.log"))
	if err != nil {
		t.Fatal(err)
	}
	if !regexp.MustCompile(`serving the dashboard.*"dashboard_url": ?"http://127\.0\.0\.1:\d+/"`).Match(log) {
		t.Fatalf("train.log does not name the dashboard's URL:\n%s", log)
	}

	code, _, stderr = runQVD(t, "train", "--max-steps", "1", "--out", t.TempDir(), "--dashboard-addr", "localhost")
	if code != exitUsage || !strings.Contains(stderr, "dashboard.addr") {
		t.Fatalf("--dashboard-addr localhost: exit %d, stderr %q; want 2 naming dashboard.addr", code, stderr)
	}
}
