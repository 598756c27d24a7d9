package launch

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/qvd/qvd/internal/memstat"
)

// Grace is how long workers get to save and exit after SIGTERM before SIGKILL.
const Grace = 30 * time.Second

// finishedGrace: once a worker of an elastic job exits 0, how often the launcher looks for
// workers that are stopped (SIGSTOP, Ctrl-Z). The job re-formed without them and is done;
// they would hold the launcher forever. Workers still running are left to finish or fail
// by themselves (one left out gives up after the rendezvous timeout).
const finishedGrace = 10 * time.Second

var (
	// ErrInterrupted: the caller's context ended and the workers were stopped (they save a
	// checkpoint first).
	ErrInterrupted = errors.New("launch: interrupted; the workers were stopped")
	// ErrFailed: a worker failed or could not start; Run has written the report.
	ErrFailed = errors.New("launch: a worker failed")
)

// Worker is one process of a launch: its global rank and the command that runs it (not yet
// started).
type Worker struct {
	Rank int
	Cmd  *exec.Cmd

	mu   sync.Mutex
	last []string // the worker's last stderr lines, for the failure report
	err  string   // the worker's last error line ("qvd: ...", "qvd join: ..."), for the blame

	// Set by Run's loop only.
	exit     workerExit
	atFail   procState // the process's state when the first worker failed
	killedBy bool      // the launcher SIGKILLed it (it ignored SIGTERM)
}

// workerExit is how a worker process ended.
type workerExit struct {
	done   bool
	err    error          // cmd.Wait's error: nil, or "exit status N", or "signal: killed"
	signal syscall.Signal // the signal that killed it, or 0
}

func (w *Worker) remember(line string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last = append(w.last, line)
	if len(w.last) > 5 {
		w.last = w.last[1:]
	}
	// Commands report their final error as "qvd: ..." or "qvd COMMAND: ...".
	if strings.HasPrefix(line, "qvd: ") || strings.HasPrefix(line, "qvd join: ") || strings.HasPrefix(line, "qvd train: ") {
		w.err = line
	}
}

// Run starts the workers, relays each line of their output to stdout and stderr as
// "[rank N] line", and supervises them: when one fails, or ctx ends, it sends every other
// SIGTERM (SIGKILL after Grace). It writes its own account to stderr as "qvd launch: ..."
// lines — a worker that could not start, the stop, the workers' peak RSS, and for a failure
// the rank at its root (failureReport). It returns nil when every worker exited 0,
// ErrInterrupted when ctx stopped them, and ErrFailed otherwise; the cause is already
// reported.
func Run(ctx context.Context, workers []*Worker, stdout, stderr io.Writer) error {
	return RunElastic(ctx, workers, 0, stdout, stderr)
}

// RunElastic is Run for an elastic job (elastic.min_nodes minAlive > 0): a worker that fails
// while at least minAlive others still run is reported and left out — the survivors re-form
// and keep training — instead of stopping the others. It returns nil when the workers still
// running at the end all exited 0; a failure that leaves fewer than minAlive running stops
// the rest as Run does.
func RunElastic(ctx context.Context, workers []*Worker, minAlive int, stdout, stderr io.Writer) error {
	var outMu sync.Mutex
	relay := func(w *Worker, r io.Reader, dst io.Writer, keep bool, done ...*sync.WaitGroup) {
		defer func() {
			for _, d := range done {
				d.Done()
			}
		}()
		// A line too long for the scanner ends the scan: drain the rest so the worker
		// never blocks on a full pipe and its exit can still be collected.
		defer io.Copy(io.Discard, r)
		sc := bufio.NewScanner(r)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if keep {
				w.remember(line)
			}
			outMu.Lock()
			fmt.Fprintf(dst, "[rank %d] %s\n", w.Rank, line)
			outMu.Unlock()
		}
	}
	type exit struct {
		w   *Worker
		err error
	}
	exits := make(chan exit, len(workers))
	var relays sync.WaitGroup
	started := 0
	for _, w := range workers {
		so, err1 := w.Cmd.StdoutPipe()
		se, err2 := w.Cmd.StderrPipe()
		if err := errors.Join(err1, err2); err != nil {
			fmt.Fprintf(stderr, "qvd launch: %v\n", err)
			break
		}
		if err := w.Cmd.Start(); err != nil {
			fmt.Fprintf(stderr, "qvd launch: starting rank %d: %v\n", w.Rank, err)
			break
		}
		started++
		// Wait closes the pipes once the process exits, so it may only be called after both
		// relays have read to EOF; otherwise a failing worker's last words can be lost.
		var own sync.WaitGroup
		own.Add(2)
		relays.Add(2)
		go relay(w, so, stdout, false, &relays, &own)
		go relay(w, se, stderr, true, &relays, &own)
		go func(w *Worker) {
			own.Wait()
			err := w.Cmd.Wait()
			exits <- exit{w, err}
		}(w)
	}
	signalAll := func(sig syscall.Signal) {
		for _, w := range workers {
			if w.Cmd.Process != nil && w.Cmd.ProcessState == nil {
				_ = w.Cmd.Process.Signal(sig)
				if sig == syscall.SIGKILL {
					w.killedBy = true
				} else if readProcState(w.Cmd.Process.Pid) == procStopped {
					// A stopped process (SIGSTOP, Ctrl-Z) only acts on SIGTERM once continued.
					_ = w.Cmd.Process.Signal(syscall.SIGCONT)
				}
			}
		}
	}
	var result error
	var failed *exit
	lost := 0 // workers an elastic job went on without
	stopping := false
	var kill <-chan time.Time
	// finished: an elastic job's worker exited 0, so the job is done; a worker that is
	// stopped once finishedGrace has passed was left out of it and is killed (leftOut).
	var finished <-chan time.Time
	leftOut := map[*Worker]bool{}
	if started < len(workers) {
		result, stopping = ErrFailed, true
		signalAll(syscall.SIGTERM)
		kill = time.After(Grace)
	}
	for remaining := started; remaining > 0; {
		select {
		case e := <-exits:
			remaining--
			e.w.exit = exitOf(e.w.Cmd, e.err)
			if minAlive > 0 && e.err == nil && !stopping && finished == nil {
				finished = time.After(finishedGrace)
			}
			if e.err != nil && leftOut[e.w] {
				lost++ // left out of the job, then stopped by us
				continue
			}
			if e.err != nil && !stopping && minAlive > 0 && remaining >= minAlive {
				outMu.Lock()
				fmt.Fprintf(stderr, "qvd launch: rank %d exited (%v); the job continues with %d workers (elastic.min_nodes %d)\n", e.w.Rank, e.err, remaining, minAlive)
				outMu.Unlock()
				lost++
				continue
			}
			if e.err != nil && failed == nil && !stopping {
				failed = &e
				// What the others were doing when this one failed: the rank its error
				// blames may be stopped or hung rather than dead.
				for _, w := range workers {
					w.atFail = procExited
					if !w.exit.done && w.Cmd.Process != nil {
						w.atFail = readProcState(w.Cmd.Process.Pid)
					}
				}
				result = ErrFailed
				stopping = true
				signalAll(syscall.SIGTERM)
				kill = time.After(Grace)
			}
			if e.err != nil && result == nil {
				result = ErrFailed
			}
		case <-ctx.Done():
			if !stopping {
				stopping = true
				outMu.Lock()
				fmt.Fprintln(stderr, "qvd launch: stopping the workers (they save a checkpoint first)")
				outMu.Unlock()
				signalAll(syscall.SIGTERM)
				kill = time.After(Grace)
				result = ErrInterrupted
			}
			ctx = context.Background() // report once
		case <-kill:
			signalAll(syscall.SIGKILL)
			kill = nil
		case <-finished:
			finished = time.After(finishedGrace)
			for _, w := range workers {
				if !stopping && !leftOut[w] && w.Cmd.Process != nil && !w.exit.done && readProcState(w.Cmd.Process.Pid) == procStopped {
					outMu.Lock()
					fmt.Fprintf(stderr, "qvd launch: the job finished without rank %d, which is stopped: killing it\n", w.Rank)
					outMu.Unlock()
					leftOut[w] = true
					_ = w.Cmd.Process.Signal(syscall.SIGKILL) // not in the job: nothing of it to save
				}
			}
		}
	}
	relays.Wait()
	if peaks := peakRSS(workers); peaks != "" {
		fmt.Fprintf(stderr, "qvd launch: peak RSS (the kernel's high-water mark of each worker process): %s\n", peaks)
	}
	if failed != nil {
		fmt.Fprint(stderr, failureReport(failed.w, workers))
	}
	if lost > 0 && result == nil {
		fmt.Fprintf(stderr, "qvd launch: the job finished without %d of its %d workers (elastic)\n", lost, len(workers))
	}
	return result
}

// procState is a worker process's state as /proc shows it.
type procState int

const (
	procRunning procState = iota // running or sleeping: alive (or the state is unknown)
	procStopped                  // stopped by a signal (SIGSTOP, Ctrl-Z) or a debugger
	procExited                   // exited (a zombie not yet reaped counts)
)

// readProcState reads the state letter of /proc/PID/stat (proc(5)): T stopped, t stopped by
// a tracer, Z zombie, X dead; anything else is alive. Without /proc it says running.
func readProcState(pid int) procState {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) && runtime.GOOS == "linux" {
			return procExited
		}
		return procRunning
	}
	// "pid (comm) S ...": comm may hold spaces and parentheses, so look after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return procRunning
	}
	switch b[i+2] {
	case 'T', 't':
		return procStopped
	case 'Z', 'X', 'x':
		return procExited
	}
	return procRunning
}

// exitOf records how cmd ended, after Wait returned err.
func exitOf(cmd *exec.Cmd, err error) workerExit {
	e := workerExit{done: true, err: err}
	if cmd.ProcessState != nil {
		if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			e.signal = ws.Signal()
		}
	}
	return e
}

// blameRE finds the rank an error names as its cause: collective.PeerError ("collective
// all-reduce (tag 7): rank 1 (127.0.0.1:4242): collective: peer timed out"; an abort names
// the rank that failed first), the gossip watcher ("rank 1 (launch-001 at ...) failed") and
// the rendezvous ("rank 1 (launch-001 at ...): ...") all write "rank N (" first.
var blameRE = regexp.MustCompile(`\brank (\d+) \(`)

// blamedRank is the rank errLine names as the cause, or -1.
func blamedRank(errLine string) int {
	m := blameRE.FindStringSubmatch(errLine)
	if m == nil {
		return -1
	}
	r, err := strconv.Atoi(m[1])
	if err != nil {
		return -1
	}
	return r
}

// failureReport is the launcher's account of a failed job. It leads with the first cause,
// not the first exit: when a rank stops answering (stopped, hung), the ranks that wait for
// it fail first, with errors that name it, while it is still alive. So the headline names
// the rank that the first failing worker's error blames, and says what had become of it
// when that worker failed: "not responding" (alive or stopped), "died" (killed by a signal
// the launcher did not send) or "failed" (exited with an error).
func failureReport(first *Worker, workers []*Worker) string {
	// Follow the blame: a blamed rank that itself failed blaming another was only waiting
	// for that one too (two survivors can fail in the same instant, the one that blames
	// the other first). Ranks are global: with --nnodes the blamed rank may be elsewhere.
	// What the launcher saw itself comes first: a worker stopped when the first failure came,
	// or one killed by a signal the launcher did not send. Ranks waiting on it can blame each
	// other (in a ring, each times out on the link it reads), so their errors come last.
	culprit := first
	for _, w := range workers {
		// (Killed before the first failure: the launcher's own SIGTERMs come after it.)
		if w.atFail == procStopped || w.atFail == procExited && w.exit.signal != 0 && !w.killedBy {
			return report(first, w)
		}
	}
	seen := map[int]bool{first.Rank: true}
	for {
		r := blamedRank(culprit.err)
		if r < 0 || seen[r] {
			break
		}
		next := (*Worker)(nil)
		for _, w := range workers {
			if w.Rank == r {
				next = w
			}
		}
		if next == nil {
			break
		}
		seen[r], culprit = true, next
	}
	return report(first, culprit)
}

// report is the headline: the culprit and its verdict, and the first failure's last lines.
func report(first, culprit *Worker) string {
	var b strings.Builder
	fmt.Fprintf(&b, "qvd launch: rank %d %s", culprit.Rank, verdict(culprit, culprit == first))
	lines := func(w *Worker) {
		if len(w.last) > 0 {
			fmt.Fprintf(&b, ":\n  %s", strings.Join(w.last, "\n  "))
		}
		b.WriteString("\n")
	}
	if culprit == first {
		lines(first)
		return b.String()
	}
	fmt.Fprintf(&b, "; rank %d was the first to fail", first.Rank)
	lines(first)
	return b.String()
}

// verdict says what became of w: for the first failing worker, how it exited; for another
// that it blamed, what state it was in at that moment.
func verdict(w *Worker, first bool) string {
	state := w.atFail
	if first {
		state = procExited
	}
	switch state {
	case procStopped:
		return "not responding (its process is stopped: SIGSTOP, Ctrl-Z or a debugger)"
	case procRunning:
		return "not responding (alive, but it stopped answering the other ranks)"
	}
	switch {
	case w.exit.signal != 0 && !w.killedBy:
		return fmt.Sprintf("died (killed by %s)", SignalName(w.exit.signal))
	case w.exit.err != nil:
		return fmt.Sprintf("failed (%v)", w.exit.err)
	}
	return "exited"
}

// SignalName is the signal's conventional name ("SIGTERM"), as kill -l lists it.
func SignalName(s syscall.Signal) string {
	names := map[syscall.Signal]string{
		syscall.SIGHUP: "SIGHUP", syscall.SIGINT: "SIGINT", syscall.SIGQUIT: "SIGQUIT", syscall.SIGABRT: "SIGABRT",
		syscall.SIGKILL: "SIGKILL", syscall.SIGSEGV: "SIGSEGV", syscall.SIGBUS: "SIGBUS", syscall.SIGPIPE: "SIGPIPE",
		syscall.SIGTERM: "SIGTERM", syscall.SIGSTOP: "SIGSTOP", syscall.SIGUSR1: "SIGUSR1", syscall.SIGUSR2: "SIGUSR2",
	}
	if n, ok := names[s]; ok {
		return n
	}
	return fmt.Sprintf("signal %d (%v)", int(s), s)
}

// peakRSS lists the exited workers' resident-set high-water marks as the kernel measured
// them (wait4's ru_maxrss), what a user's memory limit is up against: "rank 0 1.21 GiB, ...".
func peakRSS(workers []*Worker) string {
	var parts []string
	for _, w := range workers {
		if w.Cmd.ProcessState == nil {
			continue
		}
		if ru, ok := w.Cmd.ProcessState.SysUsage().(*syscall.Rusage); ok && ru.Maxrss > 0 {
			parts = append(parts, fmt.Sprintf("rank %d %s", w.Rank, memstat.FormatBytes(uint64(ru.Maxrss)<<10)))
		}
	}
	return strings.Join(parts, ", ")
}
