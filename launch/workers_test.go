package launch

import (
	"errors"
	"fmt"
	"strings"
	"syscall"
	"testing"

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
