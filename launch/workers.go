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
	// Name and Bind are the worker's node name and gossip address; a restart (Elastic.Rejoin)
	// takes both over. A Bind with port 0 (the worker picks a free port) cannot be joined
	// through.
	Name, Bind string

	mu    sync.Mutex
	last  []string // the worker's last stderr lines, for the failure report
	err   string   // the worker's last error line ("qvd: ...", "qvd join: ..."), for the blame
	inJob bool     // a worker of the launch, or a restart that has written joinedMarker

	// Set by Run's loop only.
	exit     workerExit
	atFail   procState // the process's state when the first worker failed
	killedBy bool      // the launcher SIGKILLed it (it ignored SIGTERM)
	restart  int       // 0 for a worker of the launch, i for the i-th restart of the launch
	replaced bool      // it failed and a restart took its place
}

// workerExit is how a worker process ended.
type workerExit struct {
	done   bool
	err    error          // cmd.Wait's error: nil, or "exit status N", or "signal: killed"
	signal syscall.Signal // the signal that killed it, or 0
}

// joinedMarker is what a worker logs (job.go, at info level, the default of `qvd join`) each
// time it is in a group of the job: a restart that wrote it was admitted.
const joinedMarker = "joined the job"

// observe notes a line of the worker's stdout or stderr.
func (w *Worker) observe(line string) {
	if strings.Contains(line, joinedMarker) {
		w.mu.Lock()
		w.inJob = true
		w.mu.Unlock()
	}
}

// admitted reports whether w is a worker of the job: one the launch started, or a restart
// that was admitted.
func (w *Worker) admitted() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.inJob
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
	return RunElastic(ctx, workers, Elastic{}, stdout, stderr)
}

// MaxRestartsLimit bounds Elastic.MaxRestarts: enough for any soak, small enough that a
// worker failing at start (a bad flag) cannot keep a launcher busy for long.
const MaxRestartsLimit = 10000

// Elastic is how RunElastic treats a worker that fails while the job runs. The zero value is
// Run's: any failure stops the job.
type Elastic struct {
	// MinAlive > 0 (elastic.min_nodes, --min-nodes): a worker that fails while at least
	// MinAlive others still run is left out; the survivors re-form and keep training.
	MinAlive int
	// MaxRestarts (torchrun's --max-restarts) is how many times in all, over the launch, a
	// worker that fails while the job runs is started again, by Rejoin, as a worker that joins
	// the running job through a live one. Once they are used up, MinAlive decides.
	MaxRestarts int
	// Rejoin builds the command of w's replacement: a `qvd join peer` under w's node name,
	// gossip address and environment; peer is the gossip address of a local worker that is
	// alive and in the job (one the launch started, or a restart that logged joinedMarker).
	// Required with MaxRestarts > 0 (Train.Rejoin).
	Rejoin func(w *Worker, peer string) *exec.Cmd
	// AllLocal: every worker of the job is one of these (one machine). Then a failure that
	// leaves no worker in the job means the job is lost, and RunElastic stops the restarts
	// that wait to join it rather than let them wait out the rendezvous timeout.
	AllLocal bool
}

// Validate checks e; the errors name launch's flags.
func (e Elastic) Validate() error {
	switch {
	case e.MinAlive < 0:
		return fmt.Errorf("--min-nodes must be ≥ 0, got %d", e.MinAlive)
	case e.MaxRestarts < 0 || e.MaxRestarts > MaxRestartsLimit:
		return fmt.Errorf("--max-restarts must be in [0, %d], got %d", MaxRestartsLimit, e.MaxRestarts)
	case e.MaxRestarts > 0 && e.MinAlive == 0:
		return fmt.Errorf("--max-restarts %d needs --min-nodes > 0: a restarted worker joins the running job, which only an elastic job admits", e.MaxRestarts)
	case e.MaxRestarts > 0 && e.Rejoin == nil:
		return errors.New("launch: Elastic.MaxRestarts > 0 without a Rejoin command")
	}
	return nil
}

// RunElastic is Run for an elastic job (el.MinAlive > 0): a worker that fails while the job
// runs is restarted as a worker that joins it (while el.MaxRestarts lasts and a local worker
// is alive to join through), or else, while at least el.MinAlive others still run, reported
// and left out — the survivors re-form and keep training — instead of stopping the others.
// Nothing is restarted once ctx has ended or a worker has exited 0 (the job is done; the
// others finish). It returns nil when the workers still running at the end all exited 0;
// a failure that leaves fewer than el.MinAlive running, with no restart, stops the rest as
// Run does.
func RunElastic(ctx context.Context, workers []*Worker, el Elastic, stdout, stderr io.Writer) error {
	if err := el.Validate(); err != nil {
		return err
	}
	minAlive := el.MinAlive
	var outMu sync.Mutex
	say := func(format string, a ...any) {
		outMu.Lock()
		defer outMu.Unlock()
		fmt.Fprintf(stderr, "qvd launch: "+format+"\n", a...)
	}
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
			w.observe(line)
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
	// A restart adds a process, so the channel holds every exit the launch can have.
	exits := make(chan exit, len(workers)+el.MaxRestarts)
	var relays sync.WaitGroup
	start := func(w *Worker) error {
		so, err1 := w.Cmd.StdoutPipe()
		se, err2 := w.Cmd.StderrPipe()
		if err := errors.Join(err1, err2); err != nil {
			return err
		}
		if err := w.Cmd.Start(); err != nil {
			return fmt.Errorf("starting rank %d: %w", w.Rank, err)
		}
		// Wait closes the pipes once the process exits, so it may only be called after both
		// relays have read to EOF; otherwise a failing worker's last words can be lost.
		var own sync.WaitGroup
		own.Add(2)
		relays.Add(2)
		go relay(w, so, stdout, false, &relays, &own)
		go relay(w, se, stderr, true, &relays, &own)
		go func() {
			own.Wait()
			err := w.Cmd.Wait()
			exits <- exit{w, err}
		}()
		return nil
	}
	// all holds every process of the launch, restarts included, in the order they started.
	all := append([]*Worker(nil), workers...)
	for _, w := range workers {
		w.inJob = true // they form the job
	}
	started := 0
	for _, w := range workers {
		if err := start(w); err != nil {
			say("%v", err)
			break
		}
		started++
	}
	signalAll := func(sig syscall.Signal) {
		for _, w := range all {
			// exit.done, set by this loop, not ProcessState, which Wait sets in its goroutine:
			// signalling a process Wait has just reaped is harmless (Signal says it is done).
			if w.Cmd.Process != nil && !w.exit.done {
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
	// inJob lists the local workers other than w that are in the job and alive (not stopped).
	inJob := func(w *Worker, leftOut map[*Worker]bool) []*Worker {
		var in []*Worker
		for _, p := range all {
			if p != w && !p.exit.done && !leftOut[p] && p.Cmd.Process != nil && p.admitted() && readProcState(p.Cmd.Process.Pid) == procRunning {
				in = append(in, p)
			}
		}
		return in
	}
	// peer is the worker a restart of w joins the job through: the first started of those in
	// the job whose gossip address is known.
	peer := func(w *Worker, leftOut map[*Worker]bool) *Worker {
		for _, p := range inJob(w, leftOut) {
			if p.Bind != "" && !strings.HasSuffix(p.Bind, ":0") {
				return p
			}
		}
		return nil
	}
	var result error
	var failed *exit
	lost := 0     // workers an elastic job went on without
	restarts := 0 // restarts so far (el.MaxRestarts at most)
	stopping := false
	jobDone := false // a worker exited 0: the job is done
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
			if e.err == nil {
				jobDone = true
			}
			if minAlive > 0 && e.err == nil && !stopping && finished == nil {
				finished = time.After(finishedGrace)
			}
			if e.err != nil && leftOut[e.w] {
				lost++ // left out of the job, then stopped by us
				continue
			}
			if e.err != nil && !stopping && !jobDone && restarts < el.MaxRestarts {
				if p := peer(e.w, leftOut); p != nil {
					restarts++
					nw := &Worker{Rank: e.w.Rank, Name: e.w.Name, Bind: e.w.Bind, restart: restarts, Cmd: el.Rejoin(e.w, p.Bind)}
					say("restarting rank %d (restart %d of %d): %s; it joins through rank %d at %s", e.w.Rank, restarts, el.MaxRestarts, e.w.why(), p.Rank, p.Bind)
					err := start(nw)
					if err == nil {
						e.w.replaced = true
						all = append(all, nw)
						remaining++
						continue
					}
					say("restarting rank %d: %v", e.w.Rank, err)
				}
			}
			// With every worker of the job here, none of them left in it means it is lost: the
			// restarts still waiting would wait for a roster until the rendezvous timeout.
			lostJob := e.err != nil && !stopping && !jobDone && el.MaxRestarts > 0 && el.AllLocal && len(inJob(e.w, leftOut)) == 0
			if lostJob {
				say("the job is lost: rank %d exited (%s) and no worker left is in it (%d others run, waiting to be admitted)", e.w.Rank, e.w.why(), remaining)
			}
			if e.err != nil && !stopping && jobDone && e.w.restart > 0 {
				// Started while the job ran, it found it done before it was admitted.
				say("rank %d's restart exited (%v) after the job finished without it", e.w.Rank, e.err)
				lost++
				continue
			}
			if e.err != nil && !stopping && minAlive > 0 && remaining >= minAlive && !lostJob {
				say("rank %d exited (%v); the job continues with %d workers (elastic.min_nodes %d)", e.w.Rank, e.err, remaining, minAlive)
				lost++
				continue
			}
			if e.err != nil && failed == nil && !stopping {
				failed = &e
				// What the others were doing when this one failed: the rank its error
				// blames may be stopped or hung rather than dead.
				for _, w := range all {
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
				say("stopping the workers (they save a checkpoint first)")
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
			for _, w := range all {
				if !stopping && !leftOut[w] && w.Cmd.Process != nil && !w.exit.done && readProcState(w.Cmd.Process.Pid) == procStopped {
					say("the job finished without rank %d, which is stopped: killing it", w.Rank)
					leftOut[w] = true
					_ = w.Cmd.Process.Signal(syscall.SIGKILL) // not in the job: nothing of it to save
				}
			}
		}
	}
	relays.Wait()
	if peaks := peakRSS(all); peaks != "" {
		fmt.Fprintf(stderr, "qvd launch: peak RSS (the kernel's high-water mark of each worker process): %s\n", peaks)
	}
	if failed != nil {
		// The report is about the processes of the job's last moments: a process that a
		// restart replaced failed earlier, and the restart told why.
		var current []*Worker
		for _, w := range all {
			if !w.replaced {
				current = append(current, w)
			}
		}
		fmt.Fprint(stderr, failureReport(failed.w, current))
	}
	if restarts > 0 {
		fmt.Fprintf(stderr, "qvd launch: restarted workers %d times (--max-restarts %d)\n", restarts, el.MaxRestarts)
	}
	if lost > 0 && result == nil {
		fmt.Fprintf(stderr, "qvd launch: the job finished without %d of its %d workers (elastic)\n", lost, len(workers))
	}
	return result
}

// why says how w's process ended, for the restart notice: "killed by SIGKILL", or the exit
// status and the worker's own last error line.
func (w *Worker) why() string {
	if w.exit.signal != 0 {
		return "killed by " + SignalName(w.exit.signal)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := fmt.Sprint(w.exit.err)
	if w.err != "" {
		s += ": " + w.err
	}
	return s
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
			name := fmt.Sprintf("rank %d", w.Rank)
			if w.restart > 0 {
				name += fmt.Sprintf(" (restart %d)", w.restart)
			}
			parts = append(parts, name+" "+memstat.FormatBytes(uint64(ru.Maxrss)<<10))
		}
	}
	return strings.Join(parts, ", ")
}
