package dashboard

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/metrics"
)

const chromiumPath = "/usr/bin/chromium"

// chromiumTimeout bounds one headless Chromium run; the page needs a second or two of
// virtual time to fetch the records and draw.
const chromiumTimeout = 15 * time.Second

// runChromium runs headless Chromium on url with extra flags and returns its stdout. It runs
// in its own process group, killed as a whole when it is done, so no renderer or crash
// handler outlives the test.
func runChromium(t *testing.T, url string, extra ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), chromiumTimeout)
	defer cancel()
	args := append([]string{"--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
		"--disable-extensions", "--disable-background-networking", "--user-data-dir=" + t.TempDir(),
		"--window-size=1280,1300", "--virtual-time-budget=3000"}, extra...)
	cmd := exec.CommandContext(ctx, chromiumPath, append(args, url)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 2 * time.Second
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Start()
	if err != nil {
		t.Fatalf("starting chromium: %v", err)
	}
	err = cmd.Wait()
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) // whatever of the group is left
	if err != nil {
		t.Fatalf("chromium %v: %v (context: %v)\nstderr:\n%s", extra, err, ctx.Err(), stderr.String())
	}
	return stdout.String()
}

// TestDashboardChromium loads the page in headless Chromium against a server holding a few
// records and checks that the page's script fetched them and drew every chart: each canvas's
// data-points attribute is set by the drawing code to the number of points drawn. It also
// takes a screenshot, kept at $QVD_DASHBOARD_SCREENSHOT when that is set.
func TestDashboardChromium(t *testing.T) {
	if _, err := os.Stat(chromiumPath); err != nil {
		t.Skipf("headless Chromium not installed (apt-get install chromium; scripts/setup.sh --cuda does): %v", err)
	}
	dir := filepath.Join(t.TempDir(), "run-mlp")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "metrics.jsonl")
	const trainSteps = 40
	// A two-rank run that formed, lost rank 1 at step 30 and re-formed from its checkpoint.
	writeRecords(t, path, metrics.Record{Kind: metrics.KindEvent, Time: 1.7e9, Event: metrics.EventRendezvous, Gen: 11, World: 2, Detail: "job mlp-1"})
	for s := int64(1); s <= trainSteps; s++ {
		if s == 31 {
			writeRecords(t, path,
				metrics.Record{Kind: metrics.KindEvent, Time: 1.7e9 + 30, Event: metrics.EventMemberLost, Detail: "rank 1 (n1 at 10.0.0.2:7946) failed (no longer answers gossip)"},
				metrics.Record{Kind: metrics.KindEvent, Time: 1.7e9 + 30, Step: 30, Event: metrics.EventStopped, Detail: "failed: step 31: rank 1 lost"},
				metrics.Record{Kind: metrics.KindEvent, Time: 1.7e9 + 40, Step: 30, Event: metrics.EventRendezvous, Gen: 12, World: 2, Detail: "job mlp-2"})
		}
		r := trainRec(s)
		r.PhaseHeap = map[string]int64{"forward+backward": 40 << 20, "communication": 30 << 20, "optimizer": 35 << 20}
		if s == 21 || s == 22 {
			r.OOMSkipped = 1
		}
		r.LR = 1e-3
		r.Epoch = float64(s) / 20
		r.SamplesPerSec = 900 + float64(s%7)*20
		r.Skipped = s == 13
		if r.Skipped {
			r.Scale = 32768
		}
		writeRecords(t, path, r)
		if s == 22 {
			writeRecords(t, path, metrics.Record{Kind: metrics.KindEvent, Step: 22, Event: metrics.EventMicroBatchHalved,
				Detail: "micro-batch 16, accumulation 2 (out-of-memory micro-batches)"})
		}
		if s%10 == 0 {
			writeRecords(t, path, metrics.Record{Kind: metrics.KindMembers, Time: 1.7e9 + float64(s), Step: s, Members: []metrics.Member{
				{Name: "n0", State: "alive", Role: "coordinator", Rank: 0, Step: s, Gen: 1732450000123456789, Model: 12 << 20, RSS: 256 << 20, Peak: 40 << 20},
				{Name: "n1", State: "alive", Role: "worker", Rank: 1, Step: s - 1, Gen: 1732450000987654321, Model: 12 << 20, RSS: 250 << 20, Peak: 41 << 20},
			}})
		}
		if s%20 == 0 {
			writeRecords(t, path, metrics.Record{Kind: metrics.KindEval, Step: s, Epoch: float64(s) / 20,
				Loss: 1.5 / float64(s/20), Accuracy: 0.6 + 0.1*float64(s/20), Samples: 200})
		}
	}
	srv, err := Listen("127.0.0.1:0", New(path, "run-mlp"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
	})

	start := time.Now()
	dom := runChromium(t, srv.URL(), "--dump-dom")
	t.Logf("dump-dom took %v", time.Since(start).Round(time.Millisecond))
	for id, want := range map[string]int{"loss": trainSteps + 2, "accuracy": 2, "throughput": trainSteps} {
		m := regexp.MustCompile(`id="` + id + `"[^>]*data-points="(\d+)"`).FindStringSubmatch(dom)
		if m == nil {
			t.Fatalf("no data-points on the %s chart in the DOM:\n%s", id, dom)
		}
		if n, _ := strconv.Atoi(m[1]); n != want {
			t.Errorf("%s chart drew %d points, want %d", id, n, want)
		}
	}
	for _, want := range []string{
		"step 13: optimizer step skipped",  // the skipped step in the events
		"step 40: evaluation, accuracy 80", // the last evaluation
		"host_optimizer", "8.0 MiB",        // the memory bars
		"RSS 256.0 MiB",
		"run-mlp",
		"forward+backward", "40.0 MiB", // the phase peaks
		"step 21: 1 micro-batch ran out of memory and skipped (OOM skip)",
		"step 22: micro-batch halved, micro-batch 16",
		"member lost: rank 1 (n1 at 10.0.0.2:7946) failed",
		"step 30: run stopped, failed: step 31: rank 1 lost",
		"re-formed at step 30: 2 ranks, rendezvous generation 12 (was 2 ranks, generation 11)",
		"1732450000987654321",              // a member's generation, exact
		"2 members, from the metrics file", // the members table's source
		"250.0 MiB",                        // rank 1's RSS in the per-rank memory
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("rendered page lacks %q", want)
		}
	}
	for class, want := range map[string]int{"member": 2, "rank-row": 2} {
		if n := strings.Count(dom, `<tr class="`+class+`">`); n != want {
			t.Errorf("%d rows of class %s, want %d", n, class, want)
		}
	}
	if t.Failed() {
		t.Logf("DOM:\n%s", dom)
	}

	shot := os.Getenv("QVD_DASHBOARD_SCREENSHOT")
	if shot == "" {
		shot = filepath.Join(t.TempDir(), "dashboard.png")
	} else if shot, err = filepath.Abs(shot); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	runChromium(t, srv.URL(), "--screenshot="+shot)
	t.Logf("screenshot took %v", time.Since(start).Round(time.Millisecond))
	if err := checkPNG(shot); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", shot)
}

// steppingMembers is a live two-rank cluster whose ranks advance 3 steps per look.
type steppingMembers struct {
	mu   sync.Mutex
	step int64
}

func (s *steppingMembers) Members() []metrics.Member {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.step += 3
	return []metrics.Member{
		{Name: "launch-000", State: "alive", Role: "coordinator", Rank: 0, Step: s.step, Gen: 101, Model: 12 << 20, RSS: 300 << 20, Peak: 50 << 20},
		{Name: "launch-001", State: "alive", Role: "worker", Rank: 1, Step: s.step, Gen: 102, Model: 12 << 20, RSS: 310 << 20, Peak: 51 << 20},
		{Name: "launch-002", State: "dead", Role: "worker", Rank: 2, Step: 7, Gen: 103, Model: 12 << 20, RSS: 290 << 20},
	}
}

// TestDashboardChromiumPeer: the page of `qvd dashboard PEER` — no metrics file, members from
// a live source — lists the members with their health, each rank's memory, and a throughput
// curve in steps per second from the gossiped steps.
func TestDashboardChromiumPeer(t *testing.T) {
	if _, err := os.Stat(chromiumPath); err != nil {
		t.Skipf("headless Chromium not installed (apt-get install chromium; scripts/setup.sh --cuda does): %v", err)
	}
	srv, err := Listen("127.0.0.1:0", New("", "cluster at 10.0.0.1:7946", WithMembers(&steppingMembers{}, "gossip through 10.0.0.1:7946")))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := srv.Close(); err != nil {
			t.Error(err)
		}
	})
	dom := runChromium(t, srv.URL(), "--dump-dom")
	for _, want := range []string{
		"cluster at 10.0.0.1:7946",
		"3 members, live, gossip through 10.0.0.1:7946",
		`<td class="state-dead">dead</td>`,
		"2 (dead)", "310.0 MiB", "51.0 MiB", // rank 2's row; rank 1's RSS and heap peak
		"2 ranks alive",
		"no metrics file",
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("rendered page lacks %q", want)
		}
	}
	for class, want := range map[string]int{"member": 3, "rank-row": 3} {
		if n := strings.Count(dom, `<tr class="`+class+`">`); n != want {
			t.Errorf("%d rows of class %s, want %d", n, class, want)
		}
	}
	m := regexp.MustCompile(`id="throughput"[^>]*data-points="(\d+)"`).FindStringSubmatch(dom)
	if m == nil || m[1] == "0" {
		t.Errorf("no steps/s points on the throughput chart (%v)", m)
	}
	if t.Failed() {
		t.Logf("DOM:\n%s", dom)
	}
}

func checkPNG(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return fmt.Errorf("reading the screenshot: %w", err)
	}
	if len(b) < 10<<10 || !strings.HasPrefix(string(b), "\x89PNG") {
		return errors.New("the screenshot is not a PNG of a drawn page (" + strconv.Itoa(len(b)) + " bytes)")
	}
	return nil
}
