package launch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

// TestBlamedRank: the launcher finds the rank a worker's final error blames in the formats
// the ranks write: a collective's PeerError (the peer at fault; for an abort, the rank that
// failed first), the gossip watcher's, the rendezvous'.
func TestBlamedRank(t *testing.T) {
	timeout := &collective.PeerError{Rank: 1, Addr: "127.0.0.1:42849", Op: "all-reduce (auto tag 1464)",
		Err: fmt.Errorf("%w: no frame for 2s", collective.ErrTimeout)}
	abort := &collective.PeerError{Rank: 1, Addr: "127.0.0.1:42849", Op: "all-reduce (auto tag 1464)",
		Err: fmt.Errorf("%w (rank 2 failed: %v)", collective.ErrAborted, timeout)}
	gone := &collective.PeerError{Rank: 3, Addr: "127.0.0.1:1", Err: collective.ErrPeerGone}
	for _, c := range []struct {
		line string
		want int
	}{
		{"qvd: training failed: evaluation at step 418: reducing results: " + timeout.Error(), 1},
		{"qvd: training failed: step 9: " + abort.Error(), 1},
		{"qvd: training failed: " + gone.Error(), 3},
		{"qvd: training failed: rank 2 (launch-002 at 127.0.0.1:39627) failed (no longer answers gossip) (collective all-reduce (tag 4): rank 0 (x): context canceled)", 2},
		{"qvd: coordinate: job j gen 7: prepare refused or unanswered: rank 1 (launch-001 at 127.0.0.1:5): context deadline exceeded", 1},
		{"qvd train: invalid configuration: train.precision: must be fp32, fp16 or bf16", -1},
		{"", -1},
	} {
		if got := blamedRank(c.line); got != c.want {
			t.Errorf("blamedRank(%q) = %d, want %d", c.line, got, c.want)
		}
	}
}

// TestFailureReport: the headline names the rank the first failure blames, and what had
// become of it: stopped or alive ("not responding"), killed by a signal ("died"), or exited
// with an error ("failed").
func TestFailureReport(t *testing.T) {
	const blame1 = "qvd: training failed: collective all-reduce (tag 3): rank 1 (127.0.0.1:4): collective: peer timed out: no frame for 2s"
	const blame2 = "qvd: training failed: collective all-reduce (tag 3): rank 2 (127.0.0.1:5): collective: peer timed out: no frame for 2s"
	exited1 := workerExit{done: true, err: errors.New("exit status 1")}
	killed := workerExit{done: true, err: errors.New("signal: killed"), signal: syscall.SIGKILL}
	for _, c := range []struct {
		name      string
		first     int
		firstErr  string
		state1    procState
		exit1     workerExit
		killedBy1 bool
		want, not string
	}{
		{"stopped", 2, blame1, procStopped, exited1, false, "qvd launch: rank 1 not responding (its process is stopped", "rank 2 failed"},
		{"hung", 2, blame1, procRunning, killed, true, "qvd launch: rank 1 not responding (alive", "died"},
		{"killed", 1, "", procExited, killed, false, "qvd launch: rank 1 died (killed by SIGKILL)", "rank 2"},
		{"killed, a survivor first", 2, blame1, procExited, killed, false, "qvd launch: rank 1 died (killed by SIGKILL); rank 2 was the first to fail", "not responding"},
		{"stopped, behind a survivor that blamed a survivor", 0, blame2, procStopped, exited1, false, "qvd launch: rank 1 not responding (its process is stopped", "rank 2 not responding"},
		{"failed on its own", 1, "qvd: training failed: loading data: no such file", procExited, exited1, false, "qvd launch: rank 1 failed (exit status 1)", "rank 2"},
	} {
		t.Run(c.name, func(t *testing.T) {
			ws := make([]*Worker, 3)
			for i := range ws {
				ws[i] = &Worker{Rank: i, atFail: procRunning, exit: workerExit{done: true, err: errors.New("exit status 143")}}
			}
			ws[1].atFail, ws[1].exit, ws[1].killedBy = c.state1, c.exit1, c.killedBy1
			ws[1].last = []string{"rank 1's last words"}
			ws[2].err = blame1 // rank 2, a survivor, failed waiting for rank 1
			first := ws[c.first]
			first.err = c.firstErr
			first.last = []string{c.firstErr}
			first.exit = workerExit{done: true, err: errors.New("exit status 1")}
			if c.first == 1 {
				first.exit = c.exit1
			}
			got := failureReport(first, ws)
			if !strings.Contains(got, c.want) || strings.Contains(got, c.not) {
				t.Errorf("report:\n%s\nwant %q, and not %q", got, c.want, c.not)
			}
		})
	}
}

// TestFailureReportCycle: two survivors of a ring blame each other (each timed out on the link
// it reads); the stopped rank the launcher saw is named, not either of them.
func TestFailureReportCycle(t *testing.T) {
	blame := func(r int) string {
		return fmt.Sprintf("qvd: training failed: collective all-reduce (tag 3): rank %d (127.0.0.1:4): collective: peer timed out: no frame for 2s", r)
	}
	ws := make([]*Worker, 3)
	for i := range ws {
		ws[i] = &Worker{Rank: i, atFail: procRunning, exit: workerExit{done: true, err: errors.New("exit status 1")}}
	}
	ws[0].err, ws[2].err = blame(2), blame(0)
	ws[1].atFail = procStopped
	got := failureReport(ws[0], ws)
	if !strings.Contains(got, "qvd launch: rank 1 not responding (its process is stopped") {
		t.Errorf("report:\n%s\nwant rank 1, stopped", got)
	}
	// A worker the launcher's own SIGTERM killed (before its handler was installed) after the
	// first failure is not "died": the first failure, with an error of its own, is the cause.
	own := make([]*Worker, 2)
	for i := range own {
		own[i] = &Worker{Rank: i, atFail: procRunning, exit: workerExit{done: true, err: errors.New("signal: terminated"), signal: syscall.SIGTERM}}
	}
	own[0].err, own[0].atFail = "qvd train: invalid configuration:", procExited
	own[0].exit = workerExit{done: true, err: errors.New("exit status 2")}
	if got := failureReport(own[0], own); !strings.Contains(got, "qvd launch: rank 0 failed") {
		t.Errorf("report with a SIGTERMed bystander:\n%s\nwant rank 0 failed", got)
	}
	// Without a stopped or killed worker, the cycle ends the search at a rank in it.
	ws[1].atFail = procRunning
	if got := failureReport(ws[0], ws); !strings.Contains(got, "qvd launch: rank ") {
		t.Errorf("report without evidence:\n%s", got)
	}
}

func TestFlagValue(t *testing.T) {
	if v, ok := FlagValue([]string{"-c", "x", "--data=/d", "--lr", "1"}, "data"); !ok || v != "/d" {
		t.Errorf("FlagValue: %q %v", v, ok)
	}
}

// TestTrainWorkers: rank 0 coordinates the whole world at the coordinator's address; the
// others join it at free ports, named in rank order; a worker on another node takes --data.
func TestTrainWorkers(t *testing.T) {
	tr := Train{Exe: "qvd", Nodes: Nodes{NNodes: 2, NodeRank: 0}, NProc: 2, Args: []string{"-c", "x", "--data", "/d"}, Common: []string{"--tls-ca", "ca"},
		Place: Placement{Host: "10.0.0.1", Coord: "master:29500", CoordBind: "10.0.0.1:29500"}}
	got := func(w *Worker) string { return strings.Join(w.Cmd.Args[1:], " ") }
	ws := tr.Workers()
	if want := "train -c x --data /d --nodes 4 --bind 10.0.0.1:29500 --node-name launch-000 --grpc-bind 10.0.0.1:0 --tls-ca ca"; got(ws[0]) != want {
		t.Errorf("rank 0: %s\nwant %s", got(ws[0]), want)
	}
	if want := "join master:29500 --bind 10.0.0.1:0 --node-name launch-001 --data /d --grpc-bind 10.0.0.1:0 --tls-ca ca"; got(ws[1]) != want {
		t.Errorf("rank 1: %s\nwant %s", got(ws[1]), want)
	}
	if env := strings.Join(ws[1].Cmd.Env, " "); env != LocalRankEnv+"=1 "+LaunchedEnv+"=1" {
		t.Errorf("rank 1's environment: %s", env)
	}
	tr.Nodes.NodeRank = 1
	if w := tr.Workers()[0]; w.Rank != 2 || !strings.Contains(got(w), "--node-name launch-002") {
		t.Errorf("node 1's first worker: rank %d, %s", w.Rank, got(w))
	}
}

// fakeJob runs RunElastic over fake workers: shell loops that record their pid (dir/pid.wI)
// and the peer each process joined through (dir/peers.wI), and exit 0 once dir/done exists,
// or with the status written in dir/exit.wI; once dir/admit.wI exists, they log what a worker
// admitted to the job logs. Tests drive them with signals and files.
type fakeJob struct {
	t      *testing.T
	dir    string
	stderr syncBuffer
	err    chan error
}

const fakeWorker = `echo "$2" >> "$D/peers.$1"
echo $$ > "$D/pid.$1.tmp" && mv "$D/pid.$1.tmp" "$D/pid.$1"
while :; do
	[ -e "$D/done" ] && exit 0
	[ -e "$D/exit.$1" ] && s=$(cat "$D/exit.$1") && rm "$D/exit.$1" && exit $s
	[ -e "$D/admit.$1" ] && echo "INFO	joined the job	{}" >&2 && rm "$D/admit.$1"
	sleep 0.02
done`

func fakeCmd(dir, name, peer string) *exec.Cmd {
	cmd := exec.Command("sh", "-c", fakeWorker, "sh", name, peer)
	cmd.Env = []string{"D=" + dir, "PATH=" + os.Getenv("PATH")}
	return cmd
}

// startFakeJob starts n fake workers, w0 … wN-1 at 127.0.0.1:20000+i, under el (whose
// Rejoin it sets when el restarts), and waits until each has started.
func startFakeJob(ctx context.Context, t *testing.T, n int, el Elastic) *fakeJob {
	t.Helper()
	j := &fakeJob{t: t, dir: t.TempDir(), err: make(chan error, 1)}
	var ws []*Worker
	for i := range n {
		name := fmt.Sprintf("w%d", i)
		ws = append(ws, &Worker{Rank: i, Name: name, Bind: fmt.Sprintf("127.0.0.1:%d", 20000+i), Cmd: fakeCmd(j.dir, name, "")})
	}
	if el.MaxRestarts > 0 {
		el.Rejoin = func(w *Worker, peer string) *exec.Cmd { return fakeCmd(j.dir, w.Name, peer) }
	}
	go func() { j.err <- RunElastic(ctx, ws, el, io.Discard, &j.stderr) }()
	for i := range n {
		j.pid(i, 0)
	}
	return j
}

// pid waits for a process of worker i other than pid not, and returns its pid.
func (j *fakeJob) pid(i, not int) int {
	j.t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		b, err := os.ReadFile(filepath.Join(j.dir, fmt.Sprintf("pid.w%d", i)))
		if p, _ := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && p != 0 && p != not {
			return p
		}
	}
	j.t.Fatalf("no new process of worker %d (old pid %d)\nstderr:\n%s", i, not, j.stderr.String())
	return 0
}

// kill SIGKILLs worker i's current process and returns its pid.
func (j *fakeJob) kill(i int) int {
	j.t.Helper()
	p := j.pid(i, 0)
	if err := syscall.Kill(p, syscall.SIGKILL); err != nil {
		j.t.Fatal(err)
	}
	return p
}

// exit makes worker i's current process exit with status, and waits until the launcher has
// reaped it (and a little longer, for its loop to take the exit in).
func (j *fakeJob) exit(i, status int) {
	j.t.Helper()
	p := j.pid(i, 0)
	j.touch(fmt.Sprintf("exit.w%d", i), strconv.Itoa(status))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", p)); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			j.t.Fatalf("worker %d (pid %d) was not reaped", i, p)
		}
	}
	time.Sleep(100 * time.Millisecond)
}

func (j *fakeJob) touch(name, content string) {
	j.t.Helper()
	if err := os.WriteFile(filepath.Join(j.dir, name), []byte(content), 0o644); err != nil {
		j.t.Fatal(err)
	}
}

// wait is RunElastic's result and the launcher's report.
func (j *fakeJob) wait() (string, error) {
	j.t.Helper()
	select {
	case err := <-j.err:
		return j.stderr.String(), err
	case <-time.After(30 * time.Second):
		j.t.Fatalf("RunElastic did not return\nstderr:\n%s", j.stderr.String())
	}
	return "", nil
}

// peers are the peers worker i's processes joined through, in order ("" for the first).
func (j *fakeJob) peers(i int) []string {
	b, _ := os.ReadFile(filepath.Join(j.dir, fmt.Sprintf("peers.w%d", i)))
	return strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRestartOnKill: a worker killed while the job runs is restarted as a joiner through a
// live worker — the coordinator (rank 0) too — and a restart killed in turn is restarted
// again; the job then ends with exit 0, having lost no worker.
func TestRestartOnKill(t *testing.T) {
	j := startFakeJob(context.Background(), t, 3, Elastic{MinAlive: 2, MaxRestarts: 3})
	j.pid(1, j.kill(1))
	j.pid(0, j.kill(0)) // the coordinator: its restart joins through the oldest live worker
	j.pid(0, j.kill(0)) // the restart itself dies
	j.touch("done", "")
	report, err := j.wait()
	if err != nil {
		t.Fatalf("RunElastic: %v, want nil\n%s", err, report)
	}
	if got, want := j.peers(1), []string{"", "127.0.0.1:20000"}; !slices.Equal(got, want) {
		t.Errorf("rank 1's processes joined through %q, want %q", got, want)
	}
	if got, want := j.peers(0), []string{"", "127.0.0.1:20002", "127.0.0.1:20002"}; !slices.Equal(got, want) {
		t.Errorf("rank 0's processes joined through %q, want %q", got, want)
	}
	for _, want := range []string{
		"qvd launch: restarting rank 1 (restart 1 of 3): killed by SIGKILL; it joins through rank 0 at 127.0.0.1:20000\n",
		"qvd launch: restarting rank 0 (restart 2 of 3): killed by SIGKILL; it joins through rank 2 at 127.0.0.1:20002\n",
		"qvd launch: restarting rank 0 (restart 3 of 3): killed by SIGKILL",
		"qvd launch: restarted workers 3 times (--max-restarts 3)\n",
	} {
		if !strings.Contains(report, want) {
			t.Errorf("report lacks %q:\n%s", want, report)
		}
	}
	if strings.Contains(report, "finished without") {
		t.Errorf("no worker was lost; the report says otherwise:\n%s", report)
	}
}

// TestRestartWhy: a worker that exits non-zero is restarted with its status and last error
// line in the notice.
func TestRestartWhy(t *testing.T) {
	j := startFakeJob(context.Background(), t, 2, Elastic{MinAlive: 1, MaxRestarts: 1})
	j.exit(1, 3)
	j.pid(1, 0)
	j.touch("done", "")
	report, err := j.wait()
	if err != nil || !strings.Contains(report, "qvd launch: restarting rank 1 (restart 1 of 1): exit status 3; it joins through rank 0") {
		t.Fatalf("RunElastic: %v\n%s", err, report)
	}
}

// TestNoRestartAfterFinish: once a worker exited 0 the job is done: a worker failing after
// that is not restarted; the elastic rules leave it out and the others finish.
func TestNoRestartAfterFinish(t *testing.T) {
	j := startFakeJob(context.Background(), t, 3, Elastic{MinAlive: 1, MaxRestarts: 5})
	j.exit(0, 0)
	j.exit(1, 3)
	j.touch("done", "")
	report, err := j.wait()
	if err != nil || strings.Contains(report, "restarting") || !strings.Contains(report, "rank 1 exited (exit status 3); the job continues with 1 workers") {
		t.Fatalf("RunElastic: %v; want nil, rank 1 left out and not restarted\n%s", err, report)
	}
	if got := j.peers(1); len(got) != 1 {
		t.Errorf("rank 1 ran %d times, want once", len(got))
	}
}

// TestRestartBudget: --max-restarts K counts restarts over the whole launch; once they are
// used up, the elastic rules decide — left out while min-nodes workers still run, else the
// job stops. K = 0 is the launcher without restarts.
func TestRestartBudget(t *testing.T) {
	for _, c := range []struct {
		name       string
		n, min, k  int
		restarts   int   // kills of rank 1 that are restarted
		wantErr    error // after one more kill
		wantReport string
	}{
		{"left out", 3, 2, 2, 2, nil, "qvd launch: rank 1 exited (signal: killed); the job continues with 2 workers (elastic.min_nodes 2)"},
		{"stops", 2, 2, 1, 1, ErrFailed, "qvd launch: rank 1 died (killed by SIGKILL)"},
		{"no restarts", 2, 2, 0, 0, ErrFailed, "qvd launch: rank 1 died (killed by SIGKILL)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			j := startFakeJob(context.Background(), t, c.n, Elastic{MinAlive: c.min, MaxRestarts: c.k})
			for range c.restarts {
				j.pid(1, j.kill(1))
			}
			j.kill(1)
			if c.wantErr == nil {
				time.Sleep(200 * time.Millisecond) // no restart must come: let the launcher act
				j.touch("done", "")
			}
			report, err := j.wait()
			if !errors.Is(err, c.wantErr) || !strings.Contains(report, c.wantReport) {
				t.Fatalf("RunElastic: %v, want %v and %q\n%s", err, c.wantErr, c.wantReport, report)
			}
			if got := strings.Count(report, "qvd launch: restarting"); got != c.restarts {
				t.Errorf("%d restarts, want %d\n%s", got, c.restarts, report)
			}
			if got := len(j.peers(1)); got != c.restarts+1 {
				t.Errorf("rank 1 ran %d times, want %d", got, c.restarts+1)
			}
		})
	}
}

// TestNoRestartWhenInterrupted: when the caller's context ends (Ctrl-C, SIGTERM) every worker
// is stopping; none is restarted.
func TestNoRestartWhenInterrupted(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	j := startFakeJob(ctx, t, 3, Elastic{MinAlive: 1, MaxRestarts: 5})
	cancel()
	report, err := j.wait()
	if !errors.Is(err, ErrInterrupted) || strings.Contains(report, "restarting") {
		t.Fatalf("RunElastic: %v, want ErrInterrupted without restarts\n%s", err, report)
	}
	for i := range 3 {
		if got := len(j.peers(i)); got != 1 {
			t.Errorf("rank %d ran %d times, want once", i, got)
		}
	}
}

func TestElasticValidate(t *testing.T) {
	rejoin := func(*Worker, string) *exec.Cmd { return nil }
	for _, c := range []struct {
		el   Elastic
		want string // "" valid
	}{
		{Elastic{}, ""},
		{Elastic{MinAlive: 2}, ""},
		{Elastic{MinAlive: 2, MaxRestarts: 10000, Rejoin: rejoin}, ""},
		{Elastic{MinAlive: 2, MaxRestarts: 10001, Rejoin: rejoin}, "--max-restarts must be in [0, 10000], got 10001"},
		{Elastic{MinAlive: 2, MaxRestarts: -1, Rejoin: rejoin}, "--max-restarts must be in [0, 10000], got -1"},
		{Elastic{MaxRestarts: 3, Rejoin: rejoin}, "--max-restarts 3 needs --min-nodes > 0"},
		{Elastic{MinAlive: -1}, "--min-nodes must be ≥ 0"},
		{Elastic{MinAlive: 1, MaxRestarts: 1}, "without a Rejoin"},
	} {
		err := c.el.Validate()
		if (err == nil) != (c.want == "") || err != nil && !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: Validate() = %v, want %q", c.el, err, c.want)
		}
	}
}

// TestTrainRejoin: with pinned addresses every worker binds a known port, and a restart
// joins through the peer given under the name, address and environment of the worker it
// replaces, the coordinator's too.
func TestTrainRejoin(t *testing.T) {
	tr := Train{Exe: "qvd", Nodes: Nodes{NNodes: 1}, NProc: 3, Args: []string{"-c", "x", "--data", "/d"}, Common: []string{"--tls-ca", "ca"},
		Place: Placement{Host: "127.0.0.1", Coord: "127.0.0.1:29500", CoordBind: "127.0.0.1:29500"}, MinNodes: 2, MaxRestarts: 4}
	if err := tr.PinBinds(); err != nil {
		t.Fatal(err)
	}
	if tr.Binds[0] != "127.0.0.1:29500" || tr.Binds[1] == tr.Binds[2] || strings.HasSuffix(tr.Binds[1], ":0") || strings.HasSuffix(tr.Binds[2], ":0") {
		t.Fatalf("pinned binds %q: want the coordinator's, then two distinct ports", tr.Binds)
	}
	ws := tr.Workers()
	args := func(c *exec.Cmd) string { return strings.Join(c.Args[1:], " ") }
	if want := "join 127.0.0.1:29500 --bind " + tr.Binds[2] + " --node-name launch-002 --grpc-bind 127.0.0.1:0 --tls-ca ca"; args(ws[2].Cmd) != want {
		t.Errorf("rank 2: %s\nwant %s", args(ws[2].Cmd), want)
	}
	if ws[2].Bind != tr.Binds[2] || ws[2].Name != "launch-002" {
		t.Errorf("rank 2's worker: name %q bind %q", ws[2].Name, ws[2].Bind)
	}
	re := tr.Rejoin(ws[0], ws[2].Bind)
	if want := "join " + tr.Binds[2] + " --bind 127.0.0.1:29500 --node-name launch-000 --grpc-bind 127.0.0.1:0 --tls-ca ca"; args(re) != want {
		t.Errorf("rank 0's restart: %s\nwant %s", args(re), want)
	}
	if !slices.Equal(re.Env, ws[0].Cmd.Env) || re.Path != ws[0].Cmd.Path {
		t.Errorf("rank 0's restart runs %s with %q, want %s with %q", re.Path, re.Env, ws[0].Cmd.Path, ws[0].Cmd.Env)
	}
	if el := tr.Elastic(); el.MinAlive != 2 || el.MaxRestarts != 4 || el.Validate() != nil {
		t.Errorf("Elastic() = %+v", el)
	}
}

// admit makes worker i's current process log that it joined the job, and waits until it has
// (and a little longer, for the launcher to read it).
func (j *fakeJob) admit(i int) {
	j.t.Helper()
	name := filepath.Join(j.dir, fmt.Sprintf("admit.w%d", i))
	j.touch(filepath.Base(name), "")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(name); errors.Is(err, os.ErrNotExist) {
			break
		}
		if time.Now().After(deadline) {
			j.t.Fatalf("worker %d never logged its admission", i)
		}
	}
	time.Sleep(100 * time.Millisecond)
}

// TestRestartJoinsThroughTheJob: a restart joins through a worker in the job — one the launch
// started, or a restart that logged its admission — never through one still waiting.
func TestRestartJoinsThroughTheJob(t *testing.T) {
	j := startFakeJob(context.Background(), t, 3, Elastic{MinAlive: 1, MaxRestarts: 3, AllLocal: true})
	j.pid(1, j.kill(1))
	j.admit(1)
	j.pid(0, j.kill(0)) // through rank 2, the first started of those in the job
	j.pid(2, j.kill(2)) // through rank 1's restart: rank 0's has not been admitted
	j.touch("done", "")
	report, err := j.wait()
	if err != nil {
		t.Fatalf("RunElastic: %v\n%s", err, report)
	}
	if got, want := j.peers(0), []string{"", "127.0.0.1:20002"}; !slices.Equal(got, want) {
		t.Errorf("rank 0's processes joined through %q, want %q", got, want)
	}
	if got, want := j.peers(2), []string{"", "127.0.0.1:20001"}; !slices.Equal(got, want) {
		t.Errorf("rank 2's processes joined through %q, want %q", got, want)
	}
}

// TestJobLost: when the last worker in the job fails and only restarts waiting to be admitted
// remain, the job is lost: the launcher stops them and fails at once instead of restarting.
func TestJobLost(t *testing.T) {
	j := startFakeJob(context.Background(), t, 3, Elastic{MinAlive: 1, MaxRestarts: 5, AllLocal: true})
	j.pid(1, j.kill(1))
	j.pid(2, j.kill(2))
	j.kill(0)
	report, err := j.wait()
	if !errors.Is(err, ErrFailed) || !strings.Contains(report, "qvd launch: the job is lost: rank 0 exited (killed by SIGKILL) and no worker left is in it (2 others run, waiting to be admitted)") {
		t.Fatalf("RunElastic: %v, want ErrFailed and the job lost\n%s", err, report)
	}
	if got := strings.Count(report, "qvd launch: restarting"); got != 2 {
		t.Errorf("%d restarts, want 2\n%s", got, report)
	}
	// Ranks 1 and 2 were killed too, but restarted: the report is about rank 0.
	if !strings.Contains(report, "qvd launch: rank 0 died (killed by SIGKILL)") {
		t.Errorf("the failure report does not name rank 0:\n%s", report)
	}
}
