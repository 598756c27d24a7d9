package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/memory"
)

const benchUsage = "qvd bench: give a collective: allreduce, reducescatter, allgather or broadcast (see qvd bench --help)"

func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && isHelpArg(args[:1]) { // the flags are every collective's
		return cmdBenchColl(ctx, benchColls["allreduce"], args[:1], stdout, stderr)
	}
	if len(args) == 0 {
		fmt.Fprintln(stderr, benchUsage)
		return exitUsage
	}
	coll, ok := benchColls[args[0]]
	if !ok {
		fmt.Fprintln(stderr, benchUsage)
		return exitUsage
	}
	return cmdBenchColl(ctx, coll, args[1:], stdout, stderr)
}

// benchColl is one collective as nccl-tests reports it (its *_perf programs). size is the
// bytes of the whole buffer, count the elements of the call's count argument (per rank for
// reduce-scatter and all-gather), algbw = size / time, busbw = algbw × busFactor: the
// bandwidth each link must carry, comparable across group sizes.
type benchColl struct {
	name      string // the subcommand: allreduce ...
	title     string // for the header: all-reduce ...
	redop     bool   // the redop column says "sum", else "none"
	rooted    bool   // the root column gives --root, else -1
	perRank   bool   // count is per rank: the buffer holds count × ranks elements
	busFactor func(n float64) float64
}

var benchColls = map[string]benchColl{
	"allreduce":     {"allreduce", "all-reduce", true, false, false, func(n float64) float64 { return 2 * (n - 1) / n }},
	"reducescatter": {"reducescatter", "reduce-scatter", true, false, true, func(n float64) float64 { return (n - 1) / n }},
	"allgather":     {"allgather", "all-gather", false, false, true, func(n float64) float64 { return (n - 1) / n }},
	"broadcast":     {"broadcast", "broadcast", false, true, false, func(float64) float64 { return 1 }},
}

// benchFlags are shared by the launcher and its workers.
type benchFlags struct {
	nproc         int
	sizes         string
	dtype         string
	transport     string
	root          int
	iters, warmup int
	chunk         int
	nodes         nodeFlags // the launcher's; a worker binds nodes.host
	serve         bool      // internal: run as one of the benchmark's workers
	join          string    // internal: the coordinator's gossip address (workers other than rank 0)
	mf            memberFlags
	cpuprofile    string
}

// cmdBenchColl measures one collective across N local processes, reported the way
// nccl-tests does (see benchColl), each result checked element by element.
func cmdBenchColl(ctx context.Context, coll benchColl, args []string, stdout, stderr io.Writer) int {
	var f benchFlags
	fs := newFlagSet("bench " + coll.name)
	fs.IntVar(&f.nproc, "nproc", 2, "number of processes")
	fs.StringVar(&f.sizes, "sizes", "1MiB,4MiB,16MiB,64MiB,256MiB", "comma-separated buffer sizes in bytes of the wire type (KiB/MiB/GiB, K/M/G suffixes)")
	fs.StringVar(&f.dtype, "dtype", "fp32", "element type on the wire: fp32, fp16 or bf16")
	fs.StringVar(&f.transport, "transport", "auto", "data path: auto (shared memory within a host, TCP across), shm, tcp, grpc, or nccl (a qvd built with -tags cuda)")
	fs.IntVar(&f.root, "root", 0, "broadcast's root rank")
	fs.IntVar(&f.iters, "iters", 20, "timed iterations per size")
	fs.IntVar(&f.warmup, "warmup", 3, "untimed iterations per size")
	fs.IntVar(&f.chunk, "chunk-bytes", 0, "pipelining piece size, over shared memory too (default: collective.chunk_bytes' 512 KiB)")
	f.nodes.register(fs)
	fs.BoolVar(&f.serve, "serve", false, "internal: run as a benchmark worker")
	fs.StringVar(&f.join, "join", "", "internal: coordinator address to join")
	fs.StringVar(&f.cpuprofile, "cpuprofile", "", "write rank 0's CPU profile of the timed iterations to this file")
	f.mf.register(fs)
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	sizes, err := parseSizes(f.sizes)
	wire, ferr := half.ParseFormat(f.dtype)
	switch {
	case err != nil:
		fmt.Fprintf(stderr, "qvd bench: --sizes: %v\n", err)
		return exitUsage
	case ferr != nil:
		fmt.Fprintf(stderr, "qvd bench: --dtype: %v\n", ferr)
		return exitUsage
	case f.nproc < 1 || f.nproc > 64:
		fmt.Fprintf(stderr, "qvd bench: --nproc must be in [1, 64], got %d\n", f.nproc)
		return exitUsage
	case !slices.Contains([]string{"auto", "shm", "tcp", "grpc", "nccl"}, f.transport):
		fmt.Fprintf(stderr, "qvd bench: --transport must be auto, shm, tcp, grpc or nccl, got %q\n", f.transport)
		return exitUsage
	case f.root < 0 || f.root >= f.nproc*f.nodes.nnodes:
		fmt.Fprintf(stderr, "qvd bench: --root must be in [0, %d), got %d\n", f.nproc*f.nodes.nnodes, f.root)
		return exitUsage
	case f.chunk != 0 && (f.chunk < 4<<10 || f.chunk > 64<<20):
		fmt.Fprintf(stderr, "qvd bench: --chunk-bytes must be between 4 KiB and 64 MiB, got %d\n", f.chunk)
		return exitUsage
	case f.iters < 1 || f.warmup < 0:
		fmt.Fprintln(stderr, "qvd bench: --iters must be >= 1 and --warmup >= 0")
		return exitUsage
	}
	if msg := checkNodes(f.nodes.nnodes, f.nodes.nodeRank, f.nodes.masterAddr, f.nodes.masterPort,
		f.serve || f.mf.keyFile != "" || os.Getenv(clusterKeyEnv) != ""); msg != "" {
		fmt.Fprintf(stderr, "qvd bench: %s\n", msg)
		return exitUsage
	}
	if f.serve {
		spec := benchSpec{coll: coll, wire: wire, root: f.root, iters: f.iters, warmup: f.warmup, profile: f.cpuprofile}
		return benchWorker(ctx, f, spec, sizes, stdout, stderr)
	}
	// Launcher: start nproc workers like `qvd launch` does.
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	env := os.Environ()
	if os.Getenv(clusterKeyEnv) == "" && f.mf.keyFile == "" {
		// A random key for this run, as `qvd launch` makes (a patterned one is refused).
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			fmt.Fprintf(stderr, "qvd bench: generating a cluster key: %v\n", err)
			return exitFailure
		}
		env = append(env, clusterKeyEnv+"="+hex.EncodeToString(key))
	}
	env = shareCores(env, f.nproc)
	coord, coordBind, code := f.nodes.place(ctx, fs, "qvd bench", stderr)
	if code != exitOK {
		return code
	}
	world := f.nproc * f.nodes.nnodes
	common := []string{"bench", coll.name, "--serve", "--nproc", strconv.Itoa(world), "--sizes", f.sizes, "--dtype", f.dtype,
		"--transport", f.transport, "--root", strconv.Itoa(f.root), "--iters", strconv.Itoa(f.iters), "--warmup", strconv.Itoa(f.warmup),
		"--chunk-bytes", strconv.Itoa(f.chunk), "--host", f.nodes.host}
	if f.cpuprofile != "" {
		common = append(common, "--cpuprofile", f.cpuprofile)
	}
	if f.mf.keyFile != "" {
		common = append(common, "--cluster-key-file", f.mf.keyFile)
	}
	common = append(common, f.mf.tls.args()...)
	workers := make([]*launched, f.nproc)
	for i := range workers {
		// Names sort in rank order (rendezvous orders the workers by name), so node R's
		// workers are ranks R·nproc and up, as qvd launch places them.
		rank := f.nodes.nodeRank*f.nproc + i
		a := append([]string(nil), common...)
		a = append(a, "--node-name", fmt.Sprintf("bench-%03d", rank))
		if rank == 0 {
			h, _, _ := net.SplitHostPort(coordBind)
			a = append(a, "--bind", coordBind, "--grpc-bind", net.JoinHostPort(h, "0"))
		} else {
			a = append(a, "--bind", net.JoinHostPort(f.nodes.host, "0"), "--grpc-bind", net.JoinHostPort(f.nodes.host, "0"), "--join", coord)
		}
		workers[i] = &launched{rank: rank, cmd: exec.Command(exe, a...)}
		workers[i].cmd.Env = env
	}
	return runWorkers(ctx, workers, stdout, stderr)
}

func benchWorker(ctx context.Context, f benchFlags, spec benchSpec, sizes []int64, stdout, stderr io.Writer) int {
	lg, err := newLogger(stderr, "", zapcore.WarnLevel)
	if err != nil {
		return exitFailure
	}
	defer lg.close()
	role := cluster.RoleCoordinator
	if f.join != "" {
		role = cluster.RoleWorker
	}
	job := ""
	if role == cluster.RoleCoordinator {
		job = newJobID("bench")
	}
	m, err := startMember(configs.Default().Cluster, cluster.TLSConfig{}, role, job, f.mf, lg.log)
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	defer m.Close()
	var roster *cluster.Roster
	if f.join != "" {
		if err = joinWithRetry(ctx, m, f.join, time.Minute, lg.log); err == nil {
			roster, err = m.node.AwaitRoster(ctx)
		}
	} else {
		roster, err = m.node.Coordinate(ctx, job, f.nproc, []byte("bench"))
	}
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	ccfg := collective.DefaultConfig()
	ccfg.Transport = f.transport
	if f.chunk > 0 { // --chunk-bytes: every ring's pieces, shared memory's too
		ccfg.ChunkBytes, ccfg.ShmChunkBytes = f.chunk, f.chunk
	}
	if f.transport == "nccl" {
		ccfg.Transport = "grpc" // NCCL's unique id is exchanged over the gRPC ring
	}
	d, err := m.communicator(ctx, roster, ccfg)
	if err == nil && f.transport == "nccl" {
		var nc collective.Communicator
		if nc, err = ncclOver(ctx, d.comm, roster.Rank, engine.DefaultConfig()); err != nil {
			d.Close()
		}
		d.comm = nc
	}
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	defer d.Close()
	comm := d.comm
	if comm.Rank() == 0 {
		plan := string(d.plan)
		if f.transport == "nccl" {
			plan = "nccl"
		}
		pieces := ccfg.ChunkBytes
		if d.plan == collective.PlanShm {
			pieces = ccfg.ForShm().ChunkBytes
		}
		pieceText := fmt.Sprintf("pieces of %d bytes", pieces)
		if d.plan == collective.PlanHierarchical {
			pieceText = fmt.Sprintf("pieces of %d bytes within a host, %d across", ccfg.ForShm().ChunkBytes, ccfg.ChunkBytes)
		}
		fmt.Fprintf(stdout, "# qvd %s: %d ranks, %s on the wire, %s transport (%s), %d iterations (+%d warm-up), %s\n",
			spec.coll.title, comm.Size(), spec.wire, plan, f.transport, f.iters, f.warmup, pieceText)
	}
	wrong, err := runBench(ctx, comm, spec, sizes, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	// Everyone finishes before anyone leaves, so no rank sees a peer vanish mid-call.
	if err := comm.Barrier(ctx); err != nil {
		lg.log.Warn("final barrier", zap.Error(err))
	}
	if wrong > 0 {
		fmt.Fprintf(stderr, "qvd bench: %s: %d wrong elements\n", spec.coll.name, wrong)
		return exitFailure
	}
	return exitOK
}

// benchSpec is what each rank of a benchmark runs.
type benchSpec struct {
	coll          benchColl
	wire          half.Format
	root          int
	iters, warmup int
	profile       string // rank 0's CPU profile of each size's in-place timed iterations; "" none
	// corrupt, if set, sees each checked result before it is checked: tests use it to
	// prove that a wrong element is counted.
	corrupt func(rank int, out []float32)
}

// errBenchSize: a size too small to give each rank an element.
var errBenchSize = errors.New("size too small")

// benchLayout returns the count column and the elements of the buffer for size bytes of
// elements elt bytes wide among n ranks. Like nccl-tests, reduce-scatter and all-gather round
// the buffer down to a multiple of n.
func benchLayout(coll benchColl, size int64, elt, n int) (count, total int, err error) {
	count = int(size / int64(elt))
	total = count
	if coll.perRank {
		count /= n
		total = count * n
	}
	if count < 1 {
		return 0, 0, fmt.Errorf("%d bytes of %d-byte elements among %d ranks: %w", size, elt, n, errBenchSize)
	}
	return count, total, nil
}

// benchExact is the largest integer each wire type holds exactly, with every integer below
// it: sums of values up to benchExact/n are exact whatever order the ring adds them in, so
// a result can be checked for equality, as nccl-tests does.
func benchExact(w half.Format) int {
	switch w {
	case half.FP16:
		return 1 << 11
	case half.BF16:
		return 1 << 8
	}
	return 1 << 24
}

// benchValue is rank's input at element i: an integer in [0, bound], different on each rank
// and scattered along the buffer so that a misplaced piece is seen.
func benchValue(rank, i, bound int) float32 {
	h := uint32(i)*2654435761 ^ uint32(rank+1)*2246822519 // Knuth's and xxHash's primes
	h ^= h >> 15
	return float32(h % uint32(bound+1))
}

// benchPoison fills the output before a checked call: a collective that leaves an element
// unwritten leaves a value no input has.
const benchPoison = -1

// benchCall runs the collective once on buf, in place.
func benchCall(ctx context.Context, comm collective.Communicator, coll benchColl, buf []float32, shards collective.Shards, root int, c collective.Call) error {
	switch coll.name {
	case "allreduce":
		return comm.AllReduce(ctx, buf, collective.Sum, c)
	case "reducescatter":
		return comm.ReduceScatter(ctx, buf, shards, collective.Sum, c)
	case "allgather":
		return comm.AllGather(ctx, buf, shards, c)
	default:
		return comm.Broadcast(ctx, buf, root, c)
	}
}

// benchInput is the part of the buffer the call reads on rank: [lo, hi).
func benchInput(coll benchColl, shards collective.Shards, rank, root, total int) (lo, hi int) {
	switch {
	case coll.name == "allgather":
		return shards[rank], shards[rank+1]
	case coll.rooted && rank != root:
		return 0, 0
	}
	return 0, total
}

// runBench runs each size out of place and in place on this rank and, on rank 0, writes
// nccl-tests' table to out. It returns the wrong elements counted over all ranks and sizes.
//
// qvd's collectives work in place, so out of place is what a caller with separate send and
// receive buffers does: copy the input into the output buffer, then call; its time includes
// the copy. In place, nccl-tests' in-place layouts (reduce-scatter's result and all-gather's
// input at rank × count) are the Communicator's own.
func runBench(ctx context.Context, comm collective.Communicator, spec benchSpec, sizes []int64, out io.Writer) (int64, error) {
	rank, n, elt := comm.Rank(), comm.Size(), spec.wire.Bytes()
	coll := spec.coll
	c := collective.Call{Wire: spec.wire}
	maxTotal := 0
	for _, size := range sizes {
		_, total, err := benchLayout(coll, size, elt, n)
		if err != nil {
			return 0, err
		}
		maxTotal = max(maxTotal, total)
	}
	// Allocated once for the largest size and viewed by prefix.
	inAll, outAll := make([]float32, maxTotal), make([]float32, maxTotal)
	bound := benchExact(spec.wire) / n
	typeName := map[half.Format]string{half.FP32: "float", half.FP16: "half", half.BF16: "bfloat16"}[spec.wire]
	redop, root := "none", -1
	if coll.redop {
		redop = "sum"
	}
	if coll.rooted {
		root = spec.root
	}
	if rank == 0 {
		fmt.Fprintf(out, "# out-of-place: the input copied into the output buffer, then the call (qvd's collectives work in place)\n#\n")
		fmt.Fprintf(out, "#%11s  %12s  %8s  %6s  %6s  %34s  %34s\n", "", "", "", "", "", "out-of-place", "in-place")
		fmt.Fprintf(out, "#%11s  %12s  %8s  %6s  %6s  %8s  %7s  %7s  %6s  %8s  %7s  %7s  %6s\n",
			"size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong")
		units := fmt.Sprintf("#%11s  %12s  %8s  %6s  %6s  %8s  %7s  %7s  %6s  %8s  %7s  %7s",
			"(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)")
		fmt.Fprintln(out, units)
	}
	var wrongAll int64
	var busSum float64
	rows := 0
	for _, size := range sizes {
		count, total, _ := benchLayout(coll, size, elt, n)
		in, buf := inAll[:total], outAll[:total]
		shards := collective.EvenShards(total, n) // count each, for the per-rank collectives
		lo, hi := benchInput(coll, shards, rank, spec.root, total)
		for i := lo; i < hi; i++ {
			in[i] = benchValue(rank, i, bound)
		}
		// stats: the two times in µs and the two wrong counts, summed over ranks below.
		var stats [4]float32
		for mode, inPlace := range []bool{false, true} {
			iter := func() error {
				if !inPlace {
					copy(buf[lo:hi], in[lo:hi])
				}
				return benchCall(ctx, comm, coll, buf, shards, spec.root, c)
			}
			copy(buf[lo:hi], in[lo:hi])
			for i := 0; i < spec.warmup; i++ {
				if err := iter(); err != nil {
					return 0, err
				}
			}
			if err := comm.Barrier(ctx); err != nil {
				return 0, err
			}
			stop := func() {}
			if inPlace && spec.profile != "" && rank == 0 {
				if pf, err := os.Create(spec.profile); err == nil && pprof.StartCPUProfile(pf) == nil {
					stop = func() { pprof.StopCPUProfile(); pf.Close() }
				}
			}
			start := time.Now()
			for i := 0; i < spec.iters; i++ {
				if err := iter(); err != nil {
					stop()
					return 0, err
				}
			}
			stats[mode] = float32(time.Since(start).Seconds() / float64(spec.iters) * 1e6)
			stop()
			// The check: one more call from fresh inputs, every element compared.
			for i := range buf {
				buf[i] = benchPoison
			}
			copy(buf[lo:hi], in[lo:hi])
			if err := benchCall(ctx, comm, coll, buf, shards, spec.root, c); err != nil {
				return 0, err
			}
			if spec.corrupt != nil {
				spec.corrupt(rank, buf)
			}
			stats[2+mode] = float32(benchWrong(coll, buf, shards, rank, spec.root, n, bound))
		}
		// nccl-tests reports the time averaged over ranks and the wrong elements summed.
		// (A float32 count is exact to 2^24 per rank; past that it is still nonzero.)
		if err := comm.AllReduce(ctx, stats[:], collective.Sum, collective.Call{}); err != nil {
			return 0, err
		}
		if rank != 0 {
			wrongAll += int64(stats[2]) + int64(stats[3])
			continue
		}
		bytes := int64(total * elt)
		fmt.Fprintf(out, "%12d  %12d  %8s  %6s  %6d", bytes, count, typeName, redop, root)
		for mode := range 2 {
			us := float64(stats[mode]) / float64(n)
			algbw := float64(bytes) / us / 1e3
			busbw := algbw * coll.busFactor(float64(n))
			busSum += busbw
			fmt.Fprintf(out, "  %8.2f  %7.3f  %7.3f  %6d", us, algbw, busbw, int64(stats[2+mode]))
		}
		fmt.Fprintln(out)
		wrongAll += int64(stats[2]) + int64(stats[3])
		rows += 2
	}
	if rank == 0 {
		verdict := "OK"
		if wrongAll > 0 {
			verdict = "FAILED"
		}
		fmt.Fprintf(out, "# Out of bounds values : %d %s\n", wrongAll, verdict)
		fmt.Fprintf(out, "# Avg bus bandwidth    : %.6g\n#\n", busSum/float64(max(rows, 1)))
	}
	return wrongAll, nil
}

// benchWrong counts the elements of rank's result that differ from what the inputs of
// benchValue give: the reduced shard for reduce-scatter, the whole buffer otherwise.
func benchWrong(coll benchColl, buf []float32, shards collective.Shards, rank, root, n, bound int) int {
	lo, hi := 0, len(buf)
	if coll.name == "reducescatter" {
		lo, hi = shards[rank], shards[rank+1]
	}
	owner := 0
	wrong := 0
	for i := lo; i < hi; i++ {
		var want float32
		switch coll.name {
		case "allreduce", "reducescatter":
			for r := 0; r < n; r++ {
				want += benchValue(r, i, bound)
			}
		case "allgather":
			for i >= shards[owner+1] {
				owner++
			}
			want = benchValue(owner, i, bound)
		default:
			want = benchValue(root, i, bound)
		}
		if buf[i] != want {
			wrong++
		}
	}
	return wrong
}

// parseSizes reads "1MiB,64MiB,512K,1024" (memory.ParseBytes' forms): each at least one
// element, at most 4 GiB, rounded down to whole float32s.
func parseSizes(s string) ([]int64, error) {
	var out []int64
	for _, part := range strings.Split(s, ",") {
		v, err := memory.ParseBytes(part)
		if err != nil {
			return nil, err
		}
		if v < 4 || v > 4<<30 {
			return nil, fmt.Errorf("size %q out of range [4, 4GiB]", strings.TrimSpace(part))
		}
		out = append(out, int64(v)/4*4)
	}
	return out, nil
}
