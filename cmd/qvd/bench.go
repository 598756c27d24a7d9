package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/half"
)

func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] != "allreduce" {
		fmt.Fprintln(stderr, "Usage: qvd bench allreduce --nproc N [--sizes 1MiB,64MiB] [--dtype fp32|fp16|bf16] [--transport grpc|tcp]")
		return exitUsage
	}
	return cmdBenchAllReduce(ctx, args[1:], stdout, stderr)
}

// benchFlags are shared by the launcher and its workers.
type benchFlags struct {
	nproc         int
	sizes         string
	dtype         string
	transport     string
	iters, warmup int
	chunk         int
	host          string
	serve         bool   // internal: run as one of the benchmark's workers
	join          string // internal: the coordinator's gossip address (workers other than rank 0)
	mf            memberFlags
	cpuprofile    string
}

// cmdBenchAllReduce measures all-reduce across N local processes, reported the way
// nccl-tests does: algbw = bytes / time, busbw = algbw × 2(N-1)/N (the bandwidth each link
// must carry, comparable across group sizes).
func cmdBenchAllReduce(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var f benchFlags
	fs := flag.NewFlagSet("qvd bench allreduce", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.IntVar(&f.nproc, "nproc", 2, "number of processes")
	fs.StringVar(&f.sizes, "sizes", "1MiB,4MiB,16MiB,64MiB,256MiB", "comma-separated buffer sizes in bytes of the wire type (KiB/MiB/GiB suffixes)")
	fs.StringVar(&f.dtype, "dtype", "fp32", "element type on the wire: fp32, fp16 or bf16")
	fs.StringVar(&f.transport, "transport", "grpc", "data path: grpc or tcp")
	fs.IntVar(&f.iters, "iters", 20, "timed iterations per size")
	fs.IntVar(&f.warmup, "warmup", 3, "untimed iterations per size")
	fs.IntVar(&f.chunk, "chunk-bytes", collective.DefaultConfig().ChunkBytes, "pipelining piece size")
	fs.StringVar(&f.host, "host", "127.0.0.1", "address the processes bind")
	fs.BoolVar(&f.serve, "serve", false, "internal: run as a benchmark worker")
	fs.StringVar(&f.join, "join", "", "internal: coordinator address to join")
	fs.StringVar(&f.cpuprofile, "cpuprofile", "", "write rank 0's CPU profile of the timed iterations to this file")
	f.mf.register(fs)
	if err := fs.Parse(args); err != nil {
		return exitUsage
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
	case f.transport != "grpc" && f.transport != "tcp":
		fmt.Fprintf(stderr, "qvd bench: --transport must be grpc or tcp, got %q\n", f.transport)
		return exitUsage
	case f.iters < 1 || f.warmup < 0:
		fmt.Fprintln(stderr, "qvd bench: --iters must be >= 1 and --warmup >= 0")
		return exitUsage
	}
	if f.serve {
		return benchWorker(ctx, f, sizes, wire, stdout, stderr)
	}
	// Launcher: start nproc workers like `qvd launch` does.
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	env := os.Environ()
	if os.Getenv(clusterKeyEnv) == "" && f.mf.keyFile == "" {
		env = append(env, clusterKeyEnv+"="+strings.Repeat("ab", 32)) // local benchmark only
	}
	env = shareCores(env, f.nproc)
	port, err := freePort(f.host)
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	coord := net.JoinHostPort(f.host, strconv.Itoa(port))
	common := []string{"bench", "allreduce", "--serve", "--nproc", strconv.Itoa(f.nproc), "--sizes", f.sizes, "--dtype", f.dtype,
		"--transport", f.transport, "--iters", strconv.Itoa(f.iters), "--warmup", strconv.Itoa(f.warmup),
		"--chunk-bytes", strconv.Itoa(f.chunk), "--host", f.host}
	if f.cpuprofile != "" {
		common = append(common, "--cpuprofile", f.cpuprofile)
	}
	if f.mf.keyFile != "" {
		common = append(common, "--cluster-key-file", f.mf.keyFile)
	}
	common = append(common, f.mf.tls.args()...)
	workers := make([]*launched, f.nproc)
	for i := range workers {
		a := append([]string(nil), common...)
		a = append(a, "--node-name", fmt.Sprintf("bench-%03d", i), "--grpc-bind", net.JoinHostPort(f.host, "0"))
		if i == 0 {
			a = append(a, "--bind", coord)
		} else {
			a = append(a, "--bind", net.JoinHostPort(f.host, "0"), "--join", coord)
		}
		workers[i] = &launched{rank: i, cmd: exec.Command(exe, a...)}
		workers[i].cmd.Env = env
	}
	return runWorkers(ctx, workers, stdout, stderr)
}

func benchWorker(ctx context.Context, f benchFlags, sizes []int64, wire half.Format, stdout, stderr io.Writer) int {
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
	ccfg.Transport, ccfg.ChunkBytes = f.transport, f.chunk
	comm, t, err := m.communicator(ctx, roster, ccfg)
	if err != nil {
		fmt.Fprintf(stderr, "qvd bench: %v\n", err)
		return exitFailure
	}
	defer t.Close()
	defer comm.Close()
	n := comm.Size()
	if comm.Rank() == 0 {
		fmt.Fprintf(stdout, "# qvd all-reduce: %d ranks, %s on the wire, %s transport, %d iterations (+%d warm-up), pieces of %d bytes\n",
			n, wire, f.transport, f.iters, f.warmup, f.chunk)
		fmt.Fprintf(stdout, "# %12s %12s %12s %10s %10s\n", "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)")
	}
	for _, size := range sizes {
		count := int(size) / wire.Bytes()
		buf := make([]float32, count)
		for i := range buf {
			buf[i] = float32(i%17) / 16
		}
		run := func(iters int) error {
			for i := 0; i < iters; i++ {
				if err := comm.AllReduce(ctx, buf, collective.Avg, collective.Call{Wire: wire}); err != nil {
					return err
				}
			}
			return nil
		}
		if err := run(f.warmup); err == nil {
			err = comm.Barrier(ctx)
		}
		stopProfile := func() {}
		if f.cpuprofile != "" && comm.Rank() == 0 {
			if pf, perr := os.Create(f.cpuprofile); perr == nil && pprof.StartCPUProfile(pf) == nil {
				stopProfile = func() { pprof.StopCPUProfile(); pf.Close() }
			}
		}
		start := time.Now()
		err := run(f.iters)
		stopProfile()
		elapsed := time.Since(start).Seconds() / float64(f.iters)
		if err != nil {
			fmt.Fprintf(stderr, "qvd bench: %v\n", err)
			return exitFailure
		}
		// The slowest rank's time is the collective's time.
		tm := []float32{float32(elapsed)}
		if err := comm.AllReduce(ctx, tm, collective.Max, collective.Call{}); err != nil {
			fmt.Fprintf(stderr, "qvd bench: %v\n", err)
			return exitFailure
		}
		if comm.Rank() == 0 {
			algbw := float64(size) / float64(tm[0]) / 1e9
			busbw := algbw * 2 * float64(n-1) / float64(n)
			fmt.Fprintf(stdout, "  %12d %12d %12.1f %10.3f %10.3f\n", size, count, float64(tm[0])*1e6, algbw, busbw)
		}
	}
	// Everyone finishes before anyone leaves, so no rank sees a peer vanish mid-call.
	if err := comm.Barrier(ctx); err != nil {
		lg.log.Warn("final barrier", zap.Error(err))
	}
	return exitOK
}

// parseSizes reads "1MiB,64MiB,1024".
func parseSizes(s string) ([]int64, error) {
	var out []int64
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		mult := int64(1)
		for suf, m := range map[string]int64{"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "KB": 1e3, "MB": 1e6, "GB": 1e9} {
			if strings.HasSuffix(part, suf) {
				part, mult = strings.TrimSuffix(part, suf), m
				break
			}
		}
		v, err := strconv.ParseFloat(part, 64)
		if err != nil || v <= 0 || v*float64(mult) > 4<<30 {
			return nil, fmt.Errorf("bad size %q (want e.g. 64MiB, at most 4GiB)", part)
		}
		out = append(out, int64(v*float64(mult))/4*4)
	}
	return out, nil
}
