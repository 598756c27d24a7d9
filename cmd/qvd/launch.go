package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"github.com/qvd/qvd/internal/memstat"
	"io"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// launchGrace is how long workers get to save and exit after SIGTERM before SIGKILL.
const launchGrace = 30 * time.Second

// launchedEnv is set in the environment of qvd launch's workers: the launcher, not its rank 0,
// prints the command that resumes an interrupted run.
const launchedEnv = "QVD_LAUNCHED"

// cmdLaunch starts N local workers on 127.0.0.1 — the first as the coordinator
// (`qvd train ... --nodes N --bind`), the others with `qvd join` — prefixes their output with
// the rank, forwards Ctrl-C/SIGTERM to all of them, and exits non-zero with the first failing
// worker's error. Like torchrun's standalone mode, but rendezvous goes through the same gossip
// cluster a multi-machine job uses.
//
// With --nnodes M > 1 it is one of M launchers, one per machine, as torchrun's static
// rendezvous (--nnodes, --node-rank, --master-addr, --master-port): launcher R starts its N
// workers as global ranks R·N … R·N+N-1; node 0's first worker coordinates the M·N processes
// at MASTER_ADDR:MASTER_PORT and every other worker joins there, binding the address that
// routes to MASTER_ADDR (or --host) at free ports. Node names launch-<global rank> make the
// ranks come out in that order. The launchers must share a cluster key (the key env or
// --cluster-key-file); the train flags count on node 0 only (others take --data alone).
func cmdLaunch(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("launch")
	nproc := fs.Int("nproc", 2, "number of local workers")
	keyFile := fs.String("cluster-key-file", "", "cluster key file (default: a fresh random key for this launch)")
	var nf nodeFlags
	nf.register(fs)
	var tf tlsFlags
	tf.register(fs)
	// launch's own flags come first; everything from the first flag it does not know is
	// passed to the coordinator's `qvd train`.
	own, rest := splitLaunchArgs(args)
	if code, ok := parseFlags(fs, own, stdout, stderr); !ok {
		return code
	}
	if *nproc < 1 || *nproc > 256 {
		fmt.Fprintf(stderr, "qvd launch: --nproc must be in [1, 256], got %d\n", *nproc)
		return exitUsage
	}
	if msg := checkNodes(nf.nnodes, nf.nodeRank, nf.masterAddr, nf.masterPort, *keyFile != "" || os.Getenv(clusterKeyEnv) != ""); msg != "" {
		fmt.Fprintf(stderr, "qvd launch: %s\n", msg)
		return exitUsage
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "qvd launch: locating the qvd binary: %v\n", err)
		return exitFailure
	}
	env := os.Environ()
	if *keyFile == "" && os.Getenv(clusterKeyEnv) == "" {
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			fmt.Fprintf(stderr, "qvd launch: generating a cluster key: %v\n", err)
			return exitFailure
		}
		// Passed in the environment, not on the command line, so it does not show in ps.
		env = append(env, clusterKeyEnv+"="+hex.EncodeToString(key))
	}
	env = shareCores(env, *nproc)
	coord, coordBind, code := nf.place(ctx, fs, "qvd launch", stderr)
	if code != exitOK {
		return code
	}
	world := nf.nnodes * *nproc
	width := max(3, len(strconv.Itoa(world-1)))
	var dataArgs []string // what a worker on another node takes from the train flags
	if d, ok := flagValue(rest, "data"); ok {
		dataArgs = []string{"--data", d}
	}
	var common []string
	if *keyFile != "" {
		common = append(common, "--cluster-key-file", *keyFile)
	}
	// Every local worker uses the same certificate (one host); QVD_TLS_* pass through the
	// environment.
	common = append(common, tf.args()...)
	workers := make([]*launched, *nproc)
	for i := range workers {
		// Node names sort in launch order, so rank i is worker i (rendezvous gives the
		// coordinator rank 0 and orders the rest by name).
		rank := nf.nodeRank**nproc + i
		name := fmt.Sprintf("launch-%0*d", width, rank)
		var a []string
		grpcHost := nf.host
		if rank == 0 {
			a = append([]string{"train"}, rest...)
			a = append(a, "--nodes", strconv.Itoa(world), "--bind", coordBind, "--node-name", name)
			grpcHost, _, _ = net.SplitHostPort(coordBind)
		} else {
			a = []string{"join", coord, "--bind", net.JoinHostPort(nf.host, "0"), "--node-name", name}
			if nf.nnodes > 1 {
				a = append(a, dataArgs...)
			}
		}
		// Any free port: gossip port + 1 may be taken on a busy machine.
		a = append(a, "--grpc-bind", net.JoinHostPort(grpcHost, "0"))
		a = append(a, common...)
		workers[i] = &launched{rank: rank, cmd: exec.Command(exe, a...)}
		// The worker's index on this machine picks its GPU (device.ordinal -1).
		workers[i].cmd.Env = append(append([]string(nil), env...), "QVD_LOCAL_RANK="+strconv.Itoa(i), launchedEnv+"=1")
	}
	code = runWorkers(ctx, workers, stdout, stderr)
	if code == exitInterrupted {
		fmt.Fprintf(stdout, "resume with: %s\n", resumeCommand(progName()+" launch", args))
	}
	return code
}

// splitLaunchArgs separates launch's own flags from the train flags after them.
func splitLaunchArgs(args []string) (own, rest []string) {
	takes := map[string]bool{"nproc": true, "cluster-key-file": true, "host": true, "tls-ca": true, "tls-cert": true, "tls-key": true,
		"nnodes": true, "node-rank": true, "master-addr": true, "master-port": true}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name := strings.TrimLeft(a, "-")
		if eq := strings.IndexByte(name, '='); eq >= 0 {
			name = name[:eq]
			if takes[name] {
				own = append(own, a)
				continue
			}
		} else if takes[name] && strings.HasPrefix(a, "-") {
			own = append(own, a)
			if i+1 < len(args) {
				own = append(own, args[i+1])
				i++
			}
			continue
		}
		if name == "h" || name == "help" {
			own = append(own, a)
			continue
		}
		return own, args[i:]
	}
	return own, nil
}

// nodeFlags are the multi-machine flags of launch and bench, as torchrun's static rendezvous.
type nodeFlags struct {
	host       string
	nnodes     int
	nodeRank   int
	masterAddr string
	masterPort int
}

func (nf *nodeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&nf.host, "host", "127.0.0.1", "address the workers bind and talk on (default 127.0.0.1; with --nnodes > 1, the address that routes to --master-addr)")
	fs.IntVar(&nf.nnodes, "nnodes", 1, "number of machines, one launcher each (torchrun's --nnodes)")
	fs.IntVar(&nf.nodeRank, "node-rank", 0, "this launcher's machine in [0, nnodes): its workers are ranks node-rank·nproc and up")
	fs.StringVar(&nf.masterAddr, "master-addr", "", "host of node 0, where its first worker coordinates (required with --nnodes > 1)")
	fs.IntVar(&nf.masterPort, "master-port", 0, "the coordinator's gossip port, gRPC on the next (default: 29500 with --nnodes > 1, else a free port)")
}

// place decides where the workers meet once the flags are checked (checkNodes): coord is the
// address the workers join, coordBind what node 0's first worker binds. With --nnodes > 1
// and no --host, host becomes the address that routes to --master-addr. A non-OK code comes
// with its message written to stderr under cmd's name.
func (nf *nodeFlags) place(ctx context.Context, fs *flag.FlagSet, cmd string, stderr io.Writer) (coord, coordBind string, code int) {
	hostSet := false
	fs.Visit(func(f *flag.Flag) { hostSet = hostSet || f.Name == "host" })
	port := nf.masterPort
	if port == 0 && nf.nnodes > 1 {
		port = defaultSlurmPort // torchrun's default MASTER_PORT
	}
	var err error
	if nf.nnodes > 1 && !hostSet {
		ip, err := resolveHost(ctx, nf.masterAddr)
		if err == nil {
			nf.host, err = routeFrom(ctx, ip, port)
		}
		if err != nil {
			fmt.Fprintf(stderr, "%s: --master-addr %s: %v (or set --host)\n", cmd, nf.masterAddr, err)
			return "", "", exitUsage
		}
	}
	if port == 0 {
		if port, err = freePort(nf.host); err != nil {
			fmt.Fprintf(stderr, "%s: %v\n", cmd, err)
			return "", "", exitFailure
		}
	}
	coord = net.JoinHostPort(nf.host, strconv.Itoa(port))
	coordBind = coord
	if nf.nnodes > 1 {
		coord = net.JoinHostPort(nf.masterAddr, strconv.Itoa(port))
		if nf.nodeRank == 0 {
			if coordBind, err = coordinatorBind(ctx, nf.masterAddr, port); err != nil {
				fmt.Fprintf(stderr, "%s: --master-addr: %v\n", cmd, err)
				return "", "", exitUsage
			}
		}
	}
	return coord, coordBind, exitOK
}

// checkNodes validates launch's multi-node flags; "" when they are fine.
func checkNodes(nnodes, nodeRank int, masterAddr string, masterPort int, haveKey bool) string {
	switch {
	case nnodes < 1 || nnodes > 256:
		return fmt.Sprintf("--nnodes must be in [1, 256], got %d", nnodes)
	case nodeRank < 0 || nodeRank >= nnodes:
		return fmt.Sprintf("--node-rank must be in [0, %d) (--nnodes), got %d", nnodes, nodeRank)
	case masterPort < 0 || masterPort > 65534:
		return fmt.Sprintf("--master-port must be in [1, 65534] (gRPC takes the next port), got %d", masterPort)
	case nnodes > 1 && masterAddr == "":
		return "--nnodes > 1 needs --master-addr, the host of node 0"
	case nnodes > 1 && !haveKey:
		return "--nnodes > 1 needs one cluster key on every node: set " + clusterKeyEnv + " or --cluster-key-file (make one with `qvd keygen`)"
	}
	return ""
}

// flagValue is the value of the flag name in args ("--name V", "--name=V", one dash or two).
func flagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if !strings.HasPrefix(a, "-") {
			continue
		}
		n, v, inline := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if n != name {
			continue
		}
		if inline {
			return v, true
		}
		if i+1 < len(args) {
			return args[i+1], true
		}
	}
	return "", false
}

type launched struct {
	rank int
	cmd  *exec.Cmd
	mu   sync.Mutex
	last []string // the worker's last stderr lines, for the failure report
	err  string   // the worker's last error line ("qvd: ...", "qvd join: ..."), for the blame

	// Set by runWorkers' loop only.
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

func (w *launched) remember(line string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.last = append(w.last, line)
	if len(w.last) > 5 {
		w.last = w.last[1:]
	}
	// Commands report their final error as "qvd: ..." or "qvd COMMAND: ..." (see main.go).
	if strings.HasPrefix(line, "qvd: ") || strings.HasPrefix(line, "qvd join: ") || strings.HasPrefix(line, "qvd train: ") {
		w.err = line
	}
}

// runWorkers starts the workers, relays their output, and supervises them.
func runWorkers(ctx context.Context, workers []*launched, stdout, stderr io.Writer) int {
	var outMu sync.Mutex
	relay := func(w *launched, r io.Reader, dst io.Writer, keep bool, done ...*sync.WaitGroup) {
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
			fmt.Fprintf(dst, "[rank %d] %s\n", w.rank, line)
			outMu.Unlock()
		}
	}
	type exit struct {
		w   *launched
		err error
	}
	exits := make(chan exit, len(workers))
	var relays sync.WaitGroup
	started := 0
	for _, w := range workers {
		so, err1 := w.cmd.StdoutPipe()
		se, err2 := w.cmd.StderrPipe()
		if err := errors.Join(err1, err2); err != nil {
			fmt.Fprintf(stderr, "qvd launch: %v\n", err)
			break
		}
		if err := w.cmd.Start(); err != nil {
			fmt.Fprintf(stderr, "qvd launch: starting rank %d: %v\n", w.rank, err)
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
		go func(w *launched) {
			own.Wait()
			err := w.cmd.Wait()
			exits <- exit{w, err}
		}(w)
	}
	signalAll := func(sig syscall.Signal) {
		for _, w := range workers {
			if w.cmd.Process != nil && w.cmd.ProcessState == nil {
				_ = w.cmd.Process.Signal(sig)
				if sig == syscall.SIGKILL {
					w.killedBy = true
				} else if readProcState(w.cmd.Process.Pid) == procStopped {
					// A stopped process (SIGSTOP, Ctrl-Z) only acts on SIGTERM once continued.
					_ = w.cmd.Process.Signal(syscall.SIGCONT)
				}
			}
		}
	}
	code := exitOK
	var failed *exit
	stopping := false
	var kill <-chan time.Time
	if started < len(workers) {
		code, stopping = exitFailure, true
		signalAll(syscall.SIGTERM)
		kill = time.After(launchGrace)
	}
	for remaining := started; remaining > 0; {
		select {
		case e := <-exits:
			remaining--
			e.w.exit = exitOf(e.w.cmd, e.err)
			if e.err != nil && failed == nil && !stopping {
				failed = &e
				// What the others were doing when this one failed: the rank its error
				// blames may be stopped or hung rather than dead.
				for _, w := range workers {
					w.atFail = procExited
					if !w.exit.done && w.cmd.Process != nil {
						w.atFail = readProcState(w.cmd.Process.Pid)
					}
				}
				code = exitFailure
				stopping = true
				signalAll(syscall.SIGTERM)
				kill = time.After(launchGrace)
			}
			if e.err != nil && code == exitOK {
				code = exitFailure
			}
		case <-ctx.Done():
			if !stopping {
				stopping = true
				outMu.Lock()
				fmt.Fprintln(stderr, "qvd launch: stopping the workers (they save a checkpoint first)")
				outMu.Unlock()
				signalAll(syscall.SIGTERM)
				kill = time.After(launchGrace)
				code = exitInterrupted
			}
			ctx = context.Background() // report once
		case <-kill:
			signalAll(syscall.SIGKILL)
			kill = nil
		}
	}
	relays.Wait()
	if peaks := peakRSS(workers); peaks != "" {
		fmt.Fprintf(stderr, "qvd launch: peak RSS (the kernel's high-water mark of each worker process): %s\n", peaks)
	}
	if failed != nil {
		fmt.Fprint(stderr, failureReport(failed.w, workers))
	}
	return code
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
func failureReport(first *launched, workers []*launched) string {
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
	seen := map[int]bool{first.rank: true}
	for {
		r := blamedRank(culprit.err)
		if r < 0 || seen[r] {
			break
		}
		next := (*launched)(nil)
		for _, w := range workers {
			if w.rank == r {
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
func report(first, culprit *launched) string {
	var b strings.Builder
	fmt.Fprintf(&b, "qvd launch: rank %d %s", culprit.rank, verdict(culprit, culprit == first))
	lines := func(w *launched) {
		if len(w.last) > 0 {
			fmt.Fprintf(&b, ":\n  %s", strings.Join(w.last, "\n  "))
		}
		b.WriteString("\n")
	}
	if culprit == first {
		lines(first)
		return b.String()
	}
	fmt.Fprintf(&b, "; rank %d was the first to fail", first.rank)
	lines(first)
	return b.String()
}

// verdict says what became of w: for the first failing worker, how it exited; for another
// that it blamed, what state it was in at that moment.
func verdict(w *launched, first bool) string {
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
		return fmt.Sprintf("died (killed by %s)", signalName(w.exit.signal))
	case w.exit.err != nil:
		return fmt.Sprintf("failed (%v)", w.exit.err)
	}
	return "exited"
}

// peakRSS lists the exited workers' resident-set high-water marks as the kernel measured
// them (wait4's ru_maxrss), what a user's memory limit is up against: "rank 0 1.21 GiB, ...".
func peakRSS(workers []*launched) string {
	var parts []string
	for _, w := range workers {
		if w.cmd.ProcessState == nil {
			continue
		}
		if ru, ok := w.cmd.ProcessState.SysUsage().(*syscall.Rusage); ok && ru.Maxrss > 0 {
			parts = append(parts, fmt.Sprintf("rank %d %s", w.rank, memstat.FormatBytes(uint64(ru.Maxrss)<<10)))
		}
	}
	return strings.Join(parts, ", ")
}

// freePort finds a port on host that is free for both TCP and UDP (gossip binds both) for
// the coordinator to bind. It picks at random below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range), where no outgoing connection can take it as its local
// port between this check and the coordinator's bind: a port the kernel hands out from
// ":0" is in that range, and a busy machine (a test suite's connections) took one that way.
// Falls back to ":0" where the range cannot be read or nothing below it is free.
func freePort(host string) (int, error) {
	if lo := ephemeralStart(); lo > 10000 {
		for range 64 {
			p := 10000 + mrand.IntN(lo-10000)
			if portFree(host, p) {
				return p, nil
			}
		}
	}
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("finding a free port on %s: %w", host, err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// portFree reports whether host:port can be bound for TCP and UDP now.
func portFree(host string, port int) bool {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return false
	}
	defer l.Close()
	u, err := net.ListenPacket("udp", addr)
	if err != nil {
		return false
	}
	u.Close()
	return true
}

// ephemeralStart is the first port of the kernel's ephemeral range, or 0 if unknown.
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return 0
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return lo
}

// shareCores gives each of n local workers an equal share of the cores, as torchrun sets
// OMP_NUM_THREADS: GOMAXPROCS for the Go runtime (the optimizer's and the collectives'
// goroutines) and OPENBLAS_NUM_THREADS for the matrix products, unless the user set them.
// Oversubscribed, idle Go processors spin and OpenBLAS threads busy-wait, stealing the cores
// the other workers need: at 4 workers on 2 cores the all-reduce runs ~8% faster this way.
func shareCores(env []string, n int) []string {
	threads := strconv.Itoa(max(1, runtime.NumCPU()/n))
	for _, k := range []string{"GOMAXPROCS", "OPENBLAS_NUM_THREADS"} {
		if os.Getenv(k) == "" {
			env = append(env, k+"="+threads)
		}
	}
	return env
}
