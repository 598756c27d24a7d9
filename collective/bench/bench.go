package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/memory"
)

// Collective is one collective as nccl-tests reports it (its *_perf programs). size is the
// bytes of the whole buffer, count the elements of the call's count argument (per rank for
// reduce-scatter and all-gather), algbw = size / time, busbw = algbw × busFactor: the
// bandwidth each link must carry, comparable across group sizes.
type Collective struct {
	Name      string // the subcommand: allreduce ...
	Title     string // for the header: all-reduce ...
	redop     bool   // the redop column says "sum", else "none"
	rooted    bool   // the root column gives --root, else -1
	perRank   bool   // count is per rank: the buffer holds count × ranks elements
	busFactor func(n float64) float64
}

var Collectives = map[string]Collective{
	"allreduce":     {"allreduce", "all-reduce", true, false, false, func(n float64) float64 { return 2 * (n - 1) / n }},
	"reducescatter": {"reducescatter", "reduce-scatter", true, false, true, func(n float64) float64 { return (n - 1) / n }},
	"allgather":     {"allgather", "all-gather", false, false, true, func(n float64) float64 { return (n - 1) / n }},
	"broadcast":     {"broadcast", "broadcast", false, true, false, func(float64) float64 { return 1 }},
}

// Spec is what each rank of a benchmark runs.
type Spec struct {
	Coll          Collective
	Wire          half.Format
	Root          int    // broadcast's root
	Iters, Warmup int    // timed and untimed iterations per size
	Profile       string // rank 0's CPU profile of each size's in-place timed iterations; "" none
	// corrupt, if set, sees each checked result before it is checked: tests use it to
	// prove that a wrong element is counted.
	corrupt func(rank int, out []float32)
}

// errSize: a size too small to give each rank an element.
var errSize = errors.New("size too small")

// layout returns the count column and the elements of the buffer for size bytes of
// elements elt bytes wide among n ranks. Like nccl-tests, reduce-scatter and all-gather round
// the buffer down to a multiple of n.
func layout(coll Collective, size int64, elt, n int) (count, total int, err error) {
	count = int(size / int64(elt))
	total = count
	if coll.perRank {
		count /= n
		total = count * n
	}
	if count < 1 {
		return 0, 0, fmt.Errorf("%d bytes of %d-byte elements among %d ranks: %w", size, elt, n, errSize)
	}
	return count, total, nil
}

// exact is the largest integer each wire type holds exactly, with every integer below
// it: sums of values up to exact/n are exact whatever order the ring adds them in, so
// a result can be checked for equality, as nccl-tests does.
func exact(w half.Format) int {
	switch w {
	case half.FP16:
		return 1 << 11
	case half.BF16:
		return 1 << 8
	}
	return 1 << 24
}

// value is rank's input at element i: an integer in [0, bound], different on each rank
// and scattered along the buffer so that a misplaced piece is seen.
func value(rank, i, bound int) float32 {
	h := uint32(i)*2654435761 ^ uint32(rank+1)*2246822519 // Knuth's and xxHash's primes
	h ^= h >> 15
	return float32(h % uint32(bound+1))
}

// poison fills the output before a checked call: a collective that leaves an element
// unwritten leaves a value no input has.
const poison = -1

// call runs the collective once on buf, in place.
func call(ctx context.Context, comm collective.Communicator, coll Collective, buf []float32, shards collective.Shards, root int, c collective.Call) error {
	switch coll.Name {
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

// input is the part of the buffer the call reads on rank: [lo, hi).
func input(coll Collective, shards collective.Shards, rank, root, total int) (lo, hi int) {
	switch {
	case coll.Name == "allgather":
		return shards[rank], shards[rank+1]
	case coll.rooted && rank != root:
		return 0, 0
	}
	return 0, total
}

// Run runs each size out of place and in place on this rank and, on rank 0, writes
// nccl-tests' table to out. It returns the wrong elements counted over all ranks and sizes.
//
// qvd's collectives work in place, so out of place is what a caller with separate send and
// receive buffers does: copy the input into the output buffer, then call; its time includes
// the copy. In place, nccl-tests' in-place layouts (reduce-scatter's result and all-gather's
// input at rank × count) are the Communicator's own.
func Run(ctx context.Context, comm collective.Communicator, spec Spec, sizes []int64, out io.Writer) (int64, error) {
	rank, n, elt := comm.Rank(), comm.Size(), spec.Wire.Bytes()
	coll := spec.Coll
	c := collective.Call{Wire: spec.Wire}
	maxTotal := 0
	for _, size := range sizes {
		_, total, err := layout(coll, size, elt, n)
		if err != nil {
			return 0, err
		}
		maxTotal = max(maxTotal, total)
	}
	// Allocated once for the largest size and viewed by prefix.
	inAll := make([]float32, maxTotal)
	outAll, free := allocBuf(comm, maxTotal)
	defer free()
	bound := exact(spec.Wire) / n
	typeName := map[half.Format]string{half.FP32: "float", half.FP16: "half", half.BF16: "bfloat16"}[spec.Wire]
	redop, root := "none", -1
	if coll.redop {
		redop = "sum"
	}
	if coll.rooted {
		root = spec.Root
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
		count, total, _ := layout(coll, size, elt, n)
		in, buf := inAll[:total], outAll[:total]
		shards := collective.EvenShards(total, n) // count each, for the per-rank collectives
		lo, hi := input(coll, shards, rank, spec.Root, total)
		for i := lo; i < hi; i++ {
			in[i] = value(rank, i, bound)
		}
		// stats: the two times in µs and the two wrong counts, summed over ranks below.
		var stats [4]float32
		for mode, inPlace := range []bool{false, true} {
			iter := func() error {
				if !inPlace {
					copy(buf[lo:hi], in[lo:hi])
				}
				return call(ctx, comm, coll, buf, shards, spec.Root, c)
			}
			copy(buf[lo:hi], in[lo:hi])
			for i := 0; i < spec.Warmup; i++ {
				if err := iter(); err != nil {
					return 0, err
				}
			}
			if err := comm.Barrier(ctx); err != nil {
				return 0, err
			}
			stop := func() {}
			if inPlace && spec.Profile != "" && rank == 0 {
				if pf, err := os.Create(spec.Profile); err == nil && pprof.StartCPUProfile(pf) == nil {
					stop = func() { pprof.StopCPUProfile(); pf.Close() }
				}
			}
			start := time.Now()
			for i := 0; i < spec.Iters; i++ {
				if err := iter(); err != nil {
					stop()
					return 0, err
				}
			}
			stats[mode] = float32(time.Since(start).Seconds() / float64(spec.Iters) * 1e6)
			stop()
			// The check: one more call from fresh inputs, every element compared.
			for i := range buf {
				buf[i] = poison
			}
			copy(buf[lo:hi], in[lo:hi])
			if err := call(ctx, comm, coll, buf, shards, spec.Root, c); err != nil {
				return 0, err
			}
			if spec.corrupt != nil {
				spec.corrupt(rank, buf)
			}
			stats[2+mode] = float32(countWrong(coll, buf, shards, rank, spec.Root, n, bound))
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

// allocBuf allocates the buffer the calls run on through the communicator where it hands
// out registered buffers (collective.SharedAllocator: shared memory, whose calls then read
// the peers' buffers in place), as a caller that owns its buffers should; else with make.
func allocBuf(comm collective.Communicator, n int) ([]float32, func()) {
	if a, ok := comm.(collective.SharedAllocator); ok {
		if b, err := a.AllocShared(n); err == nil {
			return b, func() { _ = a.FreeShared(b) }
		}
	}
	return make([]float32, n), func() {}
}

// countWrong counts the elements of rank's result that differ from what the inputs of
// value give: the reduced shard for reduce-scatter, the whole buffer otherwise.
func countWrong(coll Collective, buf []float32, shards collective.Shards, rank, root, n, bound int) int {
	lo, hi := 0, len(buf)
	if coll.Name == "reducescatter" {
		lo, hi = shards[rank], shards[rank+1]
	}
	owner := 0
	wrong := 0
	for i := lo; i < hi; i++ {
		var want float32
		switch coll.Name {
		case "allreduce", "reducescatter":
			for r := 0; r < n; r++ {
				want += value(r, i, bound)
			}
		case "allgather":
			for i >= shards[owner+1] {
				owner++
			}
			want = value(owner, i, bound)
		default:
			want = value(root, i, bound)
		}
		if buf[i] != want {
			wrong++
		}
	}
	return wrong
}

// ParseSizes reads "1MiB,64MiB,512K,1024" (memory.ParseBytes' forms): each at least one
// element, at most 4 GiB, rounded down to whole float32s.
func ParseSizes(s string) ([]int64, error) {
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

// Header is the line rank 0 writes above the table: the collective, the ranks, the wire type,
// the transport plan the communicator chose (nccl for --transport nccl) and the pieces the
// ring pipelines (cfg's, shared memory's within a host).
func Header(spec Spec, ranks int, plan collective.Plan, transport string, cfg collective.Config) string {
	name, pieces := string(plan), cfg.ChunkBytes
	if transport == "nccl" {
		name = "nccl"
	}
	if plan == collective.PlanShm {
		pieces = cfg.ForShm().ChunkBytes
	}
	pieceText := fmt.Sprintf("pieces of %d bytes", pieces)
	if plan == collective.PlanHierarchical {
		pieceText = fmt.Sprintf("pieces of %d bytes within a host, %d across", cfg.ForShm().ChunkBytes, cfg.ChunkBytes)
	}
	return fmt.Sprintf("# qvd %s: %d ranks, %s on the wire, %s transport (%s), %d iterations (+%d warm-up), %s\n",
		spec.Coll.Title, ranks, spec.Wire, name, transport, spec.Iters, spec.Warmup, pieceText)
}
