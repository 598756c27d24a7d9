package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/bench"
	"github.com/qvd/qvd/internal/cli"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

const benchUsage = "qvd bench: give a collective: allreduce, reducescatter, allgather or broadcast (see qvd bench --help)"

func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && cli.IsHelpArg(args[:1]) { // the flags are every collective's
		return cmdBenchColl(ctx, bench.Collectives["allreduce"], args[:1], stdout, stderr)
	}
	coll, ok := bench.Collective{}, len(args) > 0
	if ok {
		coll, ok = bench.Collectives[args[0]]
	}
	if !ok {
		fmt.Fprintln(stderr, benchUsage)
		return exitUsage
	}
	return cmdBenchColl(ctx, coll, args[1:], stdout, stderr)
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
// nccl-tests does (collective/bench), each result checked element by element.
func cmdBenchColl(ctx context.Context, coll bench.Collective, args []string, stdout, stderr io.Writer) int {
	var f benchFlags
	fs := newFlagSet("bench " + coll.Name)
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
	sizes, err := bench.ParseSizes(f.sizes)
	wire, ferr := half.ParseFormat(f.dtype)
	usage := ""
	switch {
	case err != nil:
		usage = fmt.Sprintf("--sizes: %v", err)
	case ferr != nil:
		usage = fmt.Sprintf("--dtype: %v", ferr)
	case f.nproc < 1 || f.nproc > 64:
		usage = fmt.Sprintf("--nproc must be in [1, 64], got %d", f.nproc)
	case collective.CheckTransport(f.transport) != nil:
		usage = fmt.Sprintf("--transport %v", collective.CheckTransport(f.transport))
	case f.root < 0 || f.root >= f.nproc*f.nodes.NNodes:
		usage = fmt.Sprintf("--root must be in [0, %d), got %d", f.nproc*f.nodes.NNodes, f.root)
	case f.chunk != 0 && (f.chunk < 4<<10 || f.chunk > 64<<20):
		usage = fmt.Sprintf("--chunk-bytes must be between 4 KiB and 64 MiB, got %d", f.chunk)
	case f.iters < 1 || f.warmup < 0:
		usage = "--iters must be >= 1 and --warmup >= 0"
	default:
		if err := f.nodes.Validate(f.serve || f.mf.keyFile != "" || os.Getenv(job.ClusterKeyEnv) != ""); err != nil {
			usage = err.Error()
		}
	}
	if usage != "" {
		fmt.Fprintf(stderr, "qvd bench: %s\n", usage)
		return exitUsage
	}
	if f.serve {
		err := job.Bench(ctx, job.BenchOptions{Spec: bench.Spec{Coll: coll, Wire: wire, Root: f.root, Iters: f.iters, Warmup: f.warmup, Profile: f.cpuprofile},
			Sizes: sizes, World: f.nproc, Join: f.join, Transport: f.transport, ChunkBytes: f.chunk, Member: f.mf.options(), Stdout: stdout, Stderr: stderr})
		if err != nil {
			fmt.Fprintf(stderr, "qvd bench: %v\n", err)
			return exitFailure
		}
		return exitOK
	}
	// Launcher: start nproc workers like `qvd launch` does.
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	env, p, code := f.nodes.prepare(ctx, fs, "qvd bench", f.mf.keyFile, f.nproc, stderr)
	if code != exitOK {
		return code
	}
	world := f.nproc * f.nodes.NNodes
	common := []string{"bench", coll.Name, "--serve", "--nproc", strconv.Itoa(world), "--sizes", f.sizes, "--dtype", f.dtype,
		"--transport", f.transport, "--root", strconv.Itoa(f.root), "--iters", strconv.Itoa(f.iters), "--warmup", strconv.Itoa(f.warmup),
		"--chunk-bytes", strconv.Itoa(f.chunk), "--host", p.Host}
	if f.cpuprofile != "" {
		common = append(common, "--cpuprofile", f.cpuprofile)
	}
	if f.mf.keyFile != "" {
		common = append(common, "--cluster-key-file", f.mf.keyFile)
	}
	b := launch.Bench{Exe: exe, Env: env, Nodes: f.nodes.Nodes, Place: p, NProc: f.nproc, Args: append(common, f.mf.tls.args()...)}
	return launchExit(launch.Run(ctx, b.Workers(), stdout, stderr))
}
