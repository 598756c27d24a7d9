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
		"--window-size=1280,900", "--virtual-time-budget=3000"}, extra...)
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
	for s := int64(1); s <= trainSteps; s++ {
		r := trainRec(s)
		r.LR = 1e-3
		r.Epoch = float64(s) / 20
		r.SamplesPerSec = 900 + float64(s%7)*20
		r.Skipped = s == 13
		if r.Skipped {
			r.Scale = 32768
		}
		writeRecords(t, path, r)
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
	} {
		if !strings.Contains(dom, want) {
			t.Errorf("rendered page lacks %q", want)
		}
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
