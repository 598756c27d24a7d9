package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
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

// startDashboard runs `qvd dashboard args...` in-process until ctx ends and returns the URL
// it prints, retrying while it fails to start (a cluster whose coordinator is not up yet).
func startDashboard(t *testing.T, ctx context.Context, args ...string) string {
	t.Helper()
	urlRE := regexp.MustCompile(`http://127\.0\.0\.1:\d+/`)
	deadline := time.Now().Add(20 * time.Second)
	for {
		out, errb := &syncBuffer{}, &syncBuffer{}
		done := make(chan int, 1)
		go func() { done <- run(ctx, append([]string{"dashboard"}, args...), out, errb) }()
		for {
			if url := urlRE.FindString(out.String()); url != "" {
				return url
			}
			select {
			case code := <-done:
				if time.Now().After(deadline) {
					t.Fatalf("dashboard exited %d\nstdout:\n%s\nstderr:\n%s", code, out, errb)
				}
				time.Sleep(300 * time.Millisecond)
			case <-time.After(20 * time.Millisecond):
				continue
			}
			break
		}
	}
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	res, err := (&http.Client{Timeout: 5 * time.Second}).Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, res.Status)
	}
	if err := json.NewDecoder(res.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

// TestDashboardPeer: `qvd dashboard PEER` joins a running two-process job as an observer and
// serves its members from gossip — both ranks alive, with their steps, generations and
// memory — and no metrics file. Rank 0 writes the rendezvous and its view of the members to
// metrics.jsonl, which `qvd dashboard RUN_DIR` shows.
func TestDashboardPeer(t *testing.T) {
	needDataset(t)
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	out := t.TempDir()
	train, trainOut := qvdCmd(t, testKey, "train", "--nodes", "2", "--bind", coord, "--grpc-bind", "127.0.0.1:0", "--node-name", "d0", "--out", out,
		"--epochs", "200", "--train-subset", "1280", "--test-subset", "200", "--quiet", "--dashboard-addr", "127.0.0.1:0")
	w, wOut := qvdCmd(t, testKey, "join", coord, "--bind", "127.0.0.1:0", "--node-name", "d1")
	for _, c := range []*exec.Cmd{train, w} {
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		defer func(c *exec.Cmd) { c.Process.Signal(syscall.SIGTERM); c.Wait() }(c)
	}
	t.Setenv(job.ClusterKeyEnv, testKey)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := startDashboard(t, ctx, coord, "--addr", "127.0.0.1:0", "--bind", "127.0.0.1:0")

	var mr dashboard.MembersResponse
	ok := func() bool {
		if !mr.Live || len(mr.Members) != 2 {
			return false
		}
		for i, m := range mr.Members {
			if m.Rank != i || m.State != "alive" || m.Step <= 0 || m.RSS == 0 || m.Model == 0 || m.Gen == 0 {
				return false
			}
		}
		return mr.Members[0].Name == "d0" && mr.Members[1].Name == "d1"
	}
	for deadline := time.Now().Add(30 * time.Second); !ok(); time.Sleep(200 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("members never showed both ranks alive with steps and memory; last %+v\ncoordinator:\n%s\nworker:\n%s", mr, trainOut, wOut)
		}
		getJSON(t, url+"api/members", &mr)
	}
	t.Logf("members: %+v", mr.Members)
	var resp dashboard.Response
	getJSON(t, url+"api/metrics?since=0", &resp)
	if !resp.NoFile || len(resp.Records) != 0 || !strings.Contains(resp.Title, coord) {
		t.Fatalf("PEER's /api/metrics: %+v, want no_file and a title naming %s", resp, coord)
	}

	// Rank 0's own dashboard (--dashboard-addr) shows the members from its node.
	log, err := os.ReadFile(filepath.Join(out, "train.log"))
	if err != nil {
		t.Fatal(err)
	}
	own := regexp.MustCompile(`"dashboard_url": ?"(http://127\.0\.0\.1:\d+/)"`).FindSubmatch(log)
	if own == nil {
		t.Fatalf("train.log names no dashboard URL:\n%s", log)
	}
	getJSON(t, string(own[1])+"api/members", &mr)
	if !mr.Live || len(mr.Members) != 2 || mr.Members[0].Name != "d0" || mr.Members[1].Rank != 1 || mr.Members[0].RSS == 0 {
		t.Fatalf("rank 0's dashboard members: %+v, want d0 and rank 1, live, with memory", mr)
	}

	// Rank 0's file: the group's formation, and members records with both ranks.
	var recs []metrics.Record
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		recs, _ = metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
		var formed, listed bool
		for _, r := range recs {
			formed = formed || (r.Kind == metrics.KindEvent && r.Event == metrics.EventRendezvous && r.World == 2 && r.Gen > 0)
			listed = listed || (r.Kind == metrics.KindMembers && len(r.Members) == 2 && r.Members[1].Rank == 1)
		}
		if formed && listed {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("metrics.jsonl has no rendezvous event (%v) or no members record with both ranks (%v) among %d records", formed, listed, len(recs))
		}
	}
}

// TestDashboardTarget: an existing path or a .jsonl name is a run; HOST:PORT with a numeric
// port that is not a path is a peer; anything else is a run directory not yet created.
func TestDashboardTarget(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "m.jsonl")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ arg, path, peer string }{
		{dir, filepath.Join(dir, "metrics.jsonl"), ""},
		{file, file, ""},
		{"runs/new.jsonl", "runs/new.jsonl", ""},
		{"runs/new", "runs/new/metrics.jsonl", ""},
		{"10.0.0.1:7946", "", "10.0.0.1:7946"},
		{"node0:7946", "", "node0:7946"},
		{"[::1]:7946", "", "[::1]:7946"},
		{"node0:http", "node0:http/metrics.jsonl", ""},
		{":7946", ":7946/metrics.jsonl", ""},
	} {
		if path, peer := job.DashboardTarget(tc.arg); path != tc.path || peer != tc.peer {
			t.Errorf("%q: path %q peer %q, want %q %q", tc.arg, path, peer, tc.path, tc.peer)
		}
	}
	code, _, stderr := runQVD(t, "dashboard", "10.0.0.1:7946", "--peer", "10.0.0.2:7946")
	if code != exitUsage || !strings.Contains(stderr, "--peer") {
		t.Fatalf("PEER and --peer: exit %d, stderr %q; want a usage error", code, stderr)
	}
}
