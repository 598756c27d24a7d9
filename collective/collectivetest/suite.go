package collectivetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
)

// Factory makes a connected group of size communicators (index = rank) and registers its
// cleanup with t.Cleanup. kill(r), if the implementation supports it, makes rank r die
// abruptly (its connections break as if the process had crashed); it is nil otherwise.
type Factory func(t *testing.T, size int) (comms []collective.Communicator, kill func(rank int))

// hangLimit bounds one case: every call gets a context with this deadline, and the suite
// reports a hang, with every goroutine's stack, if the ranks have not all returned soon
// after.
const hangLimit = 60 * time.Second

// bigLen is "a length of a few MiB" (3 MiB of fp32 and a little), which spans many pieces.
const bigLen = 3<<20/4 + 13

var (
	wires = []half.Format{half.FP32, half.FP16, half.BF16}
	// ops are the float reductions; Min is last so that ops[:3] (testSequential's draws)
	// stays the set it always was.
	ops = []collective.Op{collective.Sum, collective.Avg, collective.Max, collective.Min}
)

// Run runs the functional cases for groups of 1 to 5 ranks: AllReduce, ReduceScatter (even,
// uneven and empty shards), AllGather, Broadcast from every root, the typed AllReduceInt64
// (exact beyond 2^53 and for negatives) and BroadcastBytes (every root, odd and zero
// lengths), Barrier, concurrent tagged calls, sequential untagged calls (float and typed
// mixed), and mismatched calls between ranks (an error, not a hang or a panic). It also
// checks that no goroutine outlives the groups.
func Run(t *testing.T, f Factory) { RunSizes(t, f, 1, 2, 3, 4, 5) }

// RunShared is RunSizes with the buffers of the float cases (AllReduce, ReduceScatter,
// AllGather, Broadcast, Sequential, SequentialTyped) allocated through the communicators'
// collective.SharedAllocator, for an implementation whose calls on such buffers take another
// path (the Ring's direct path over shared memory). A group of more than one rank must offer
// it. Concurrent keeps ordinary buffers: calls on shared buffers run one at a time.
func RunShared(t *testing.T, f Factory, sizes ...int) { runSizes(t, f, true, sizes...) }

// RunSizes is Run for groups of the given sizes only, for an implementation that cannot make
// every size (NCCL needs a GPU per rank, so a machine with one GPU runs RunSizes(t, f, 1)).
// The mismatch cases run for those of the sizes from 2 to 4.
func RunSizes(t *testing.T, f Factory, sizes ...int) { runSizes(t, f, false, sizes...) }

func runSizes(t *testing.T, f Factory, shared bool, sizes ...int) {
	CheckGoroutines(t)
	var mismatch []int
	for _, n := range sizes {
		if n < 1 {
			t.Fatalf("RunSizes: a group of %d ranks", n)
		}
		if n >= 2 && n <= 4 {
			mismatch = append(mismatch, n)
		}
	}
	for _, n := range sizes {
		t.Run(fmt.Sprintf("N=%d", n), func(t *testing.T) {
			g := newGroup(t, f, n)
			g.shared = shared
			t.Run("AllReduce", g.testAllReduce)
			t.Run("ReduceScatter", g.testReduceScatter)
			t.Run("AllGather", g.testAllGather)
			t.Run("Broadcast", g.testBroadcast)
			t.Run("AllReduceInt64", g.testAllReduceInt64)
			t.Run("BroadcastBytes", g.testBroadcastBytes)
			t.Run("TypedInvalid", g.testTypedInvalid)
			t.Run("SequentialTyped", g.testSequentialTyped)
			t.Run("Barrier", g.testBarrier)
			t.Run("Concurrent", g.testConcurrent)
			t.Run("Sequential", g.testSequential)
		})
	}
	if len(mismatch) == 0 || shared {
		return
	}
	t.Run("Mismatch", func(t *testing.T) {
		for _, n := range mismatch {
			t.Run(fmt.Sprintf("N=%d", n), func(t *testing.T) { testMismatch(t, f, n) })
		}
	})
}

// group is a connected group reused by a series of cases. A case that fails replaces it, so
// one failure does not cascade into the cases after it.
type group struct {
	t     *testing.T // the test that owns the group's cleanups
	f     Factory
	n     int
	comms []collective.Communicator
	kill  func(int)
	// shared: the float cases' buffers come from the communicators' SharedAllocator (place).
	shared bool
}

// place returns bufs, or in shared mode copies of them allocated through each rank's
// communicator (freed when t ends). A group of one may have no shared memory.
func (g *group) place(t *testing.T, bufs [][]float32) [][]float32 {
	t.Helper()
	if !g.shared {
		return bufs
	}
	out := make([][]float32, len(bufs))
	for r, b := range bufs {
		out[r] = b
		a, ok := g.comms[r].(collective.SharedAllocator)
		if !ok {
			t.Fatalf("communicator %d (%T) offers no shared buffers", r, g.comms[r])
		}
		if len(b) == 0 {
			continue
		}
		s, err := a.AllocShared(len(b))
		if err != nil {
			if g.n == 1 && errors.Is(err, collective.ErrNoShared) {
				continue
			}
			t.Fatalf("rank %d: AllocShared(%d): %v", r, len(b), err)
		}
		copy(s, b)
		t.Cleanup(func() {
			if err := a.FreeShared(s); err != nil {
				t.Errorf("rank %d: FreeShared: %v", r, err)
			}
		})
		out[r] = s
	}
	return out
}

func newGroup(t *testing.T, f Factory, n int) *group {
	g := &group{t: t, f: f, n: n}
	g.renew()
	return g
}

func (g *group) renew() {
	g.comms, g.kill = g.f(g.t, g.n)
	if len(g.comms) != g.n {
		g.t.Fatalf("factory made %d communicators for a group of %d", len(g.comms), g.n)
	}
	for r, c := range g.comms {
		if c.Rank() != r || c.Size() != g.n {
			g.t.Fatalf("communicator %d reports rank %d of %d", r, c.Rank(), c.Size())
		}
	}
}

// all runs fn on every rank at once and returns each rank's error. It fails the test with
// every goroutine's stack if the ranks do not all return well after hangLimit.
func all(t *testing.T, comms []collective.Communicator, fn func(ctx context.Context, r int, c collective.Communicator) error) []error {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangLimit)
	defer cancel()
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for r, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = fn(ctx, r, c)
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(hangLimit + 10*time.Second):
		t.Fatalf("ranks still running %v after their context ended: hang\n%s", hangLimit, stacks())
	}
	return errs
}

// run is all over g's communicators; a failure is reported and the group replaced.
func (g *group) run(t *testing.T, what string, fn func(ctx context.Context, r int, c collective.Communicator) error) bool {
	t.Helper()
	errs := all(t, g.comms, fn)
	if err := errors.Join(errs...); err != nil {
		t.Errorf("%s: %v", what, err)
		g.renew()
		return false
	}
	return true
}

// bigCombo picks the (wire, op) pairs tried on the big buffer: every wire and every op
// once (all nine pairs run on the smaller lengths), to keep the suite fast.
func bigCombo(wire half.Format, op collective.Op) bool {
	return wire == half.FP32 && op == collective.Sum || wire == half.FP16 && op == collective.Avg ||
		wire == half.BF16 && op == collective.Max
}

// lengths are the buffer lengths tried for a group of n.
func lengths(n int) []int {
	l := []int{0, 1, 2, 7, n - 1, n + 1, 1000, bigLen}
	slices.Sort(l)
	return slices.Compact(l)
}

func newRand(parts ...uint64) *rand.Rand {
	var a, b uint64 = 0x9e3779b97f4a7c15, 0xbf58476d1ce4e5b9
	for _, p := range parts {
		a = (a ^ p) * 0x100000001b3
		b = b*31 + p
	}
	return rand.New(rand.NewPCG(a, b))
}

// fill writes test inputs: integers in [-1000, 1000] for an fp32 wire, so sums of up to five
// ranks are exact in any order; values spread over [-8, 8) with full fp32 fractions for
// 16-bit wires.
func fill(rng *rand.Rand, x []float32, wire half.Format) {
	for i := range x {
		u := rng.Uint64()
		if wire == half.FP32 {
			x[i] = float32(int(u%2001) - 1000)
		} else {
			x[i] = float32(int32(uint32(u))) * 0x1p-28
		}
	}
}

// poison marks elements a collective must overwrite.
const poison = float32(-31337.25)

func fillPoison(x []float32) {
	for i := range x {
		x[i] = poison
	}
}

// unit is the unit roundoff of a wire format.
func unit(w half.Format) float64 {
	switch w {
	case half.FP16:
		return 0x1p-11
	case half.BF16:
		return 0x1p-8
	}
	return 0
}

// reference is the expected reduction of in[*][i] for i in [lo, hi), with its tolerance:
// exact for fp32 and for Max and Min (the rounded extreme), within (n+1) roundings of the format for
// 16-bit sums (each partial sum is rounded once when sent, the result once by its owner).
// A group of one leaves the data untouched.
type reference struct {
	wire      half.Format
	n         int
	want, tol []float64
}

func newReference(in [][]float32, length int, wire half.Format, op collective.Op) *reference {
	n := len(in)
	ref := &reference{wire: wire, n: n, want: make([]float64, length), tol: make([]float64, length)}
	for i := range length {
		var want, tol float64
		switch {
		case n == 1:
			want = float64(in[0][i])
		case op == collective.Max:
			m := in[0][i]
			for r := 1; r < n; r++ {
				m = max(m, in[r][i])
			}
			want = float64(wire.Round(m))
		case op == collective.Min:
			m := in[0][i]
			for r := 1; r < n; r++ {
				m = min(m, in[r][i])
			}
			want = float64(wire.Round(m))
		default:
			var s, a float64
			for r := range n {
				s += float64(in[r][i])
				a += math.Abs(float64(in[r][i]))
			}
			if wire == half.FP32 {
				if op == collective.Avg {
					want = float64(float32(s) / float32(n)) // correctly rounded: operands exact
				} else {
					want = float64(float32(s))
				}
			} else {
				want = s
				tol = float64(n+1)*unit(wire)*a + float64(n)*0x1p-24
				if op == collective.Avg {
					want, tol = s/float64(n), tol/float64(n)+0x1p-24
				}
			}
		}
		ref.want[i], ref.tol[i] = want, tol
	}
	return ref
}

// check compares got[lo:hi] with the reference; a 16-bit result must also be representable
// in the wire format.
func (ref *reference) check(t *testing.T, what string, got []float32, lo, hi int) {
	t.Helper()
	bad := 0
	for i := lo; i < hi; i++ {
		g := got[i]
		ok := math.Abs(float64(g)-ref.want[i]) <= ref.tol[i]
		if ref.n > 1 && ref.wire != half.FP32 && ref.wire.Round(g) != g {
			ok = false
		}
		if !ok {
			if bad++; bad <= 5 {
				t.Errorf("%s: element %d = %v, want %v (±%g) over %v", what, i, g, ref.want[i], ref.tol[i], ref.wire)
			}
		}
	}
	if bad > 5 {
		t.Errorf("%s: %d elements wrong in all", what, bad)
	}
}

// checkCopied compares got[lo:hi] with src[lo:hi] rounded to the wire format (bit for bit;
// untouched in a group of one).
func checkCopied(t *testing.T, what string, got, src []float32, lo, hi int, wire half.Format, n int) {
	t.Helper()
	bad := 0
	for i := lo; i < hi; i++ {
		want := src[i]
		if n > 1 {
			want = wire.Round(want)
		}
		if math.Float32bits(got[i]) != math.Float32bits(want) {
			if bad++; bad <= 5 {
				t.Errorf("%s: element %d = %v, want %v (%v)", what, i, got[i], want, wire)
			}
		}
	}
	if bad > 5 {
		t.Errorf("%s: %d elements wrong in all", what, bad)
	}
}

// checkIdentical requires every rank's buffer to equal rank 0's bit for bit.
func checkIdentical(t *testing.T, what string, bufs [][]float32) {
	t.Helper()
	for r := 1; r < len(bufs); r++ {
		for i := range bufs[0] {
			if math.Float32bits(bufs[r][i]) != math.Float32bits(bufs[0][i]) {
				t.Errorf("%s: rank %d element %d = %v, rank 0 has %v: ranks disagree", what, r, i, bufs[r][i], bufs[0][i])
				return
			}
		}
	}
}

func inputs(rng *rand.Rand, n, length int, wire half.Format) (in, bufs [][]float32) {
	in = make([][]float32, n)
	bufs = make([][]float32, n)
	for r := range n {
		in[r] = make([]float32, length)
		fill(rng, in[r], wire)
		bufs[r] = slices.Clone(in[r])
	}
	return in, bufs
}

func (g *group) testAllReduce(t *testing.T) {
	for _, length := range lengths(g.n) {
		for _, wire := range wires {
			for _, op := range ops {
				if length == bigLen && !bigCombo(wire, op) {
					continue
				}
				name := fmt.Sprintf("len=%d/%v/%v", length, wire, op)
				in, bufs := inputs(newRand(1, uint64(g.n), uint64(length), uint64(wire), uint64(op)), g.n, length, wire)
				bufs = g.place(t, bufs)
				if !g.run(t, name, func(ctx context.Context, r int, c collective.Communicator) error {
					return c.AllReduce(ctx, bufs[r], op, collective.Call{Wire: wire})
				}) {
					continue
				}
				ref := newReference(in, length, wire, op)
				for r := range g.n {
					ref.check(t, fmt.Sprintf("%s rank %d", name, r), bufs[r], 0, length)
				}
				checkIdentical(t, name, bufs)
			}
		}
	}
}

// shardings are the partitions tried for a buffer of length among n ranks: even, uneven
// (random cut points) and one with empty shards (one rank owns everything).
func shardings(n, length int) map[string]collective.Shards {
	rng := newRand(2, uint64(n), uint64(length))
	uneven := make(collective.Shards, n+1)
	for i := 1; i < n; i++ {
		uneven[i] = rng.IntN(length + 1)
	}
	uneven[n] = length
	slices.Sort(uneven)
	empty := make(collective.Shards, n+1)
	for i := n/2 + 1; i <= n; i++ {
		empty[i] = length
	}
	return map[string]collective.Shards{
		"even":   collective.EvenShards(length, n),
		"uneven": uneven,
		"empty":  empty,
	}
}

func (g *group) testReduceScatter(t *testing.T) {
	for _, length := range lengths(g.n) {
		for _, sname := range []string{"even", "uneven", "empty"} {
			shards := shardings(g.n, length)[sname]
			for _, wire := range wires {
				for _, op := range ops {
					if length == bigLen && !(sname == "even" && (wire == half.FP32 && op == collective.Sum || wire == half.BF16 && op == collective.Avg)) {
						continue // the big buffer once per wire kind is enough here
					}
					name := fmt.Sprintf("len=%d/%s/%v/%v", length, sname, wire, op)
					in, bufs := inputs(newRand(3, uint64(g.n), uint64(length), uint64(wire), uint64(op)), g.n, length, wire)
					bufs = g.place(t, bufs)
					if !g.run(t, name, func(ctx context.Context, r int, c collective.Communicator) error {
						return c.ReduceScatter(ctx, bufs[r], shards, op, collective.Call{Wire: wire})
					}) {
						continue
					}
					ref := newReference(in, length, wire, op)
					for r := range g.n {
						ref.check(t, fmt.Sprintf("%s rank %d", name, r), bufs[r], shards[r], shards[r+1])
					}
				}
			}
		}
	}
}

func (g *group) testAllGather(t *testing.T) {
	for _, length := range lengths(g.n) {
		for _, sname := range []string{"even", "uneven", "empty"} {
			shards := shardings(g.n, length)[sname]
			for _, wire := range wires {
				if length == bigLen && (sname != "even" || wire != half.FP16) {
					continue
				}
				name := fmt.Sprintf("len=%d/%s/%v", length, sname, wire)
				rng := newRand(4, uint64(g.n), uint64(length), uint64(wire))
				src := make([]float32, length)
				fill(rng, src, wire)
				bufs := make([][]float32, g.n)
				for r := range g.n {
					bufs[r] = make([]float32, length)
					fillPoison(bufs[r])
					copy(bufs[r][shards[r]:shards[r+1]], src[shards[r]:shards[r+1]])
				}
				bufs = g.place(t, bufs)
				if !g.run(t, name, func(ctx context.Context, r int, c collective.Communicator) error {
					return c.AllGather(ctx, bufs[r], shards, collective.Call{Wire: wire})
				}) {
					continue
				}
				for r := range g.n {
					checkCopied(t, fmt.Sprintf("%s rank %d", name, r), bufs[r], src, 0, length, wire, g.n)
				}
			}
		}
	}
}

func (g *group) testBroadcast(t *testing.T) {
	for _, length := range lengths(g.n) {
		for root := range g.n {
			for _, wire := range wires {
				if length == bigLen && (root != g.n-1 || wire == half.BF16) {
					continue
				}
				name := fmt.Sprintf("len=%d/root=%d/%v", length, root, wire)
				rng := newRand(5, uint64(g.n), uint64(length), uint64(root), uint64(wire))
				src := make([]float32, length)
				fill(rng, src, wire)
				bufs := make([][]float32, g.n)
				for r := range g.n {
					bufs[r] = make([]float32, length)
					fillPoison(bufs[r])
				}
				copy(bufs[root], src)
				bufs = g.place(t, bufs)
				if !g.run(t, name, func(ctx context.Context, r int, c collective.Communicator) error {
					return c.Broadcast(ctx, bufs[r], root, collective.Call{Wire: wire})
				}) {
					continue
				}
				for r := range g.n {
					checkCopied(t, fmt.Sprintf("%s rank %d", name, r), bufs[r], src, 0, length, wire, g.n)
				}
			}
		}
	}
}

// bigInt64Len is a few MiB of int64s (odd), which spans many pieces.
const bigInt64Len = 3<<20/8 + 5

// fillInt64 writes values no float type carries exactly: spread over ±2^60 (beyond 2^53,
// negative half the time), with the edges of the exact float range at the start.
func fillInt64(rng *rand.Rand, x []int64) {
	edges := []int64{1<<53 + 1, -(1<<53 + 1), math.MaxInt64 / 8, math.MinInt64 / 8, -1}
	for i := range x {
		if i < len(edges) {
			x[i] = edges[i] + int64(rng.IntN(3))
			continue
		}
		x[i] = int64(rng.Uint64()) >> 3
	}
}

// refInt64 is the exact reduction of in[*][i].
func refInt64(in [][]int64, i int, op collective.Op) int64 {
	acc := in[0][i]
	for r := 1; r < len(in); r++ {
		switch op {
		case collective.Max:
			acc = max(acc, in[r][i])
		case collective.Min:
			acc = min(acc, in[r][i])
		default:
			acc += in[r][i]
		}
	}
	return acc
}

func (g *group) testAllReduceInt64(t *testing.T) {
	for _, length := range []int{0, 1, 2, 7, g.n + 1, 1001, bigInt64Len} {
		for _, op := range []collective.Op{collective.Sum, collective.Max, collective.Min} {
			if length == bigInt64Len && op != collective.Sum {
				continue
			}
			name := fmt.Sprintf("len=%d/%v", length, op)
			rng := newRand(8, uint64(g.n), uint64(length), uint64(op))
			in, bufs := make([][]int64, g.n), make([][]int64, g.n)
			for r := range g.n {
				in[r] = make([]int64, length)
				fillInt64(rng, in[r])
				bufs[r] = slices.Clone(in[r])
			}
			if !g.run(t, name, func(ctx context.Context, r int, c collective.Communicator) error {
				return c.AllReduceInt64(ctx, bufs[r], op)
			}) {
				continue
			}
			for r := range g.n {
				bad := 0
				for i := range length {
					if want := refInt64(in, i, op); bufs[r][i] != want {
						if bad++; bad <= 5 {
							t.Errorf("%s rank %d: element %d = %d, want %d", name, r, i, bufs[r][i], want)
						}
					}
				}
			}
		}
	}
}

func (g *group) testBroadcastBytes(t *testing.T) {
	for _, length := range []int{0, 1, 3, 7, 128, 1001, 1<<20 + 3} {
		for root := range g.n {
			if length > 1001 && root != g.n-1 {
				continue
			}
			name := fmt.Sprintf("len=%d/root=%d", length, root)
			rng := newRand(9, uint64(g.n), uint64(length), uint64(root))
			src := make([]byte, length)
			for i := range src {
				src[i] = byte(rng.Uint32())
			}
			bufs := make([][]byte, g.n)
			for r := range g.n {
				bufs[r] = bytes.Repeat([]byte{0xa5}, length)
			}
			copy(bufs[root], src)
			if !g.run(t, name, func(ctx context.Context, r int, c collective.Communicator) error {
				return c.BroadcastBytes(ctx, bufs[r], root)
			}) {
				continue
			}
			for r := range g.n {
				if i := firstDiff(bufs[r], src); i >= 0 {
					t.Errorf("%s rank %d: byte %d = %#x, want %#x", name, r, i, bufs[r][i], src[i])
				}
			}
		}
	}
}

// firstDiff is the first index where a and b differ, or -1.
func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

// testTypedInvalid makes every rank pass the same invalid typed call — an average of
// int64s, a broadcast root outside the group — which must fail on every rank with an error
// naming the fault, and leave the group usable.
func (g *group) testTypedInvalid(t *testing.T) {
	for _, tc := range []struct {
		name, want string
		call       func(ctx context.Context, c collective.Communicator) error
	}{
		{"int64-avg", "avg", func(ctx context.Context, c collective.Communicator) error {
			return c.AllReduceInt64(ctx, make([]int64, 8), collective.Avg)
		}},
		{"bytes-root", "root", func(ctx context.Context, c collective.Communicator) error {
			return c.BroadcastBytes(ctx, make([]byte, 8), g.n)
		}},
	} {
		errs := all(t, g.comms, func(ctx context.Context, r int, c collective.Communicator) error { return tc.call(ctx, c) })
		for r, err := range errs {
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s: rank %d: %v, want an error naming the %s", tc.name, r, err, tc.want)
			}
		}
		v := make([][]int64, g.n)
		g.run(t, tc.name+" then a valid call", func(ctx context.Context, r int, c collective.Communicator) error {
			v[r] = []int64{int64(r), -1 << 60}
			return c.AllReduceInt64(ctx, v[r], collective.Max)
		})
		for r := range g.n {
			if len(v[r]) == 2 && (v[r][0] != int64(g.n-1) || v[r][1] != -1<<60) {
				t.Errorf("%s then a valid call: rank %d got %v", tc.name, r, v[r])
			}
		}
	}
}

// testSequentialTyped makes a run of untagged calls, typed and float mixed, one after
// another on each rank without synchronisation, as trainers do (a counter all-reduce, a flag,
// a gradient all-reduce, an id broadcast).
func (g *group) testSequentialTyped(t *testing.T) {
	const count = 30
	ints := make([][][]int64, count) // [call][rank]
	raw := make([][][]byte, count)
	flts := make([][][]float32, count)
	var fin [count][][]float32
	for i := range count {
		rng := newRand(10, uint64(g.n), uint64(i))
		ints[i], raw[i], flts[i] = make([][]int64, g.n), make([][]byte, g.n), make([][]float32, g.n)
		fin[i] = make([][]float32, g.n)
		for r := range g.n {
			ints[i][r] = make([]int64, 1+i%4)
			fillInt64(rng, ints[i][r])
			raw[i][r] = make([]byte, 3+i)
			if r == i%g.n {
				for k := range raw[i][r] {
					raw[i][r][k] = byte(rng.Uint32())
				}
			}
			fin[i][r] = make([]float32, 5+7*i)
			fill(rng, fin[i][r], half.FP32)
			flts[i][r] = slices.Clone(fin[i][r])
		}
		flts[i] = g.place(t, flts[i])
	}
	inInts := make([][][]int64, count)
	for i := range count {
		inInts[i] = make([][]int64, g.n)
		for r := range g.n {
			inInts[i][r] = slices.Clone(ints[i][r])
		}
	}
	srcRaw := make([][]byte, count)
	for i := range count {
		srcRaw[i] = slices.Clone(raw[i][i%g.n])
	}
	intOps := []collective.Op{collective.Sum, collective.Max, collective.Min}
	if !g.run(t, "sequential typed", func(ctx context.Context, r int, c collective.Communicator) error {
		for i := range count {
			var err error
			switch i % 3 {
			case 0:
				err = c.AllReduceInt64(ctx, ints[i][r], intOps[i%len(intOps)])
			case 1:
				err = c.BroadcastBytes(ctx, raw[i][r], i%g.n)
			case 2:
				err = c.AllReduce(ctx, flts[i][r], collective.Sum, collective.Call{})
			}
			if err != nil {
				return fmt.Errorf("call %d: %w", i, err)
			}
		}
		return nil
	}) {
		return
	}
	for i := range count {
		for r := range g.n {
			what := fmt.Sprintf("call %d rank %d", i, r)
			switch i % 3 {
			case 0:
				for k, got := range ints[i][r] {
					if want := refInt64(inInts[i], k, intOps[i%len(intOps)]); got != want {
						t.Errorf("%s: element %d = %d, want %d", what, k, got, want)
					}
				}
			case 1:
				if k := firstDiff(raw[i][r], srcRaw[i]); k >= 0 {
					t.Errorf("%s: byte %d differs from the root's", what, k)
				}
			case 2:
				newReference(fin[i], len(fin[i][r]), half.FP32, collective.Sum).check(t, what, flts[i][r], 0, len(fin[i][r]))
			}
		}
	}
}

// testBarrier staggers the ranks' arrival and checks, with a shared counter, that none leaves
// before all have entered.
func (g *group) testBarrier(t *testing.T) {
	const rounds = 4
	var entered [rounds]atomic.Int32
	g.run(t, "barrier", func(ctx context.Context, r int, c collective.Communicator) error {
		for k := range rounds {
			time.Sleep(time.Duration((r+k)%g.n) * 3 * time.Millisecond)
			entered[k].Add(1)
			if err := c.Barrier(ctx); err != nil {
				return err
			}
			if got := entered[k].Load(); got != int32(g.n) {
				return fmt.Errorf("rank %d left barrier %d when %d of %d ranks had entered", r, k, got, g.n)
			}
		}
		return nil
	})
}

// testConcurrent runs several goroutines per rank, each making calls with its own distinct
// tags (all-reduce, all-gather, broadcast and reduce-scatter mixed).
func (g *group) testConcurrent(t *testing.T) {
	const goroutines, calls, length = 4, 3, 3001
	type result struct{ in, out [][]float32 } // per rank
	res := make([][]result, goroutines)
	for gi := range res {
		res[gi] = make([]result, calls)
		for k := range res[gi] {
			rng := newRand(6, uint64(g.n), uint64(gi), uint64(k))
			res[gi][k].in = make([][]float32, g.n)
			res[gi][k].out = make([][]float32, g.n)
			for r := range g.n {
				x := make([]float32, length)
				fill(rng, x, half.FP32)
				res[gi][k].in[r] = x
				res[gi][k].out[r] = slices.Clone(x)
			}
		}
	}
	shards := shardings(g.n, length)["uneven"]
	kind := func(gi int) string {
		return [...]string{"all-reduce", "all-gather", "broadcast", "reduce-scatter"}[gi%4]
	}
	ok := g.run(t, "concurrent", func(ctx context.Context, r int, c collective.Communicator) error {
		errs := make([]error, goroutines)
		var wg sync.WaitGroup
		for gi := range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := range calls {
					cl := collective.Call{Tag: uint64(1 + gi*calls + k)}
					buf := res[gi][k].out[r]
					var err error
					switch gi % 4 {
					case 0:
						err = c.AllReduce(ctx, buf, collective.Sum, cl)
					case 1:
						cl.Wire = half.BF16
						err = c.AllGather(ctx, buf, shards, cl)
					case 2:
						cl.Wire = half.FP16
						err = c.Broadcast(ctx, buf, gi%g.n, cl)
					case 3:
						err = c.ReduceScatter(ctx, buf, shards, collective.Max, cl)
					}
					if err != nil {
						errs[gi] = fmt.Errorf("goroutine %d call %d (%s): %w", gi, k, kind(gi), err)
						return
					}
				}
			}()
		}
		wg.Wait()
		return errors.Join(errs...)
	})
	if !ok {
		return
	}
	for gi := range goroutines {
		for k := range calls {
			in, out := res[gi][k].in, res[gi][k].out
			name := fmt.Sprintf("goroutine %d call %d (%s)", gi, k, kind(gi))
			for r := range g.n {
				what := fmt.Sprintf("%s rank %d", name, r)
				switch gi % 4 {
				case 0:
					newReference(in, length, half.FP32, collective.Sum).check(t, what, out[r], 0, length)
				case 1:
					for s := range g.n {
						checkCopied(t, what, out[r], in[s], shards[s], shards[s+1], half.BF16, g.n)
					}
				case 2:
					checkCopied(t, what, out[r], in[gi%g.n], 0, length, half.FP16, g.n)
				case 3:
					newReference(in, length, half.FP32, collective.Max).check(t, what, out[r], shards[r], shards[r+1])
				}
			}
		}
	}
}

// seqCall is one call of testSequential, the same on every rank.
type seqCall struct {
	kind   int // 0 all-reduce, 1 reduce-scatter, 2 all-gather, 3 broadcast, 4 barrier
	length int
	wire   half.Format
	op     collective.Op
	root   int
	shards collective.Shards
}

// testSequential makes a run of untagged calls of every kind, one after another on each rank
// without any synchronisation between the ranks, so that fast ranks run ahead into later
// calls while slow ones finish earlier ones.
func (g *group) testSequential(t *testing.T) {
	const count = 40
	rng := newRand(7, uint64(g.n))
	plan := make([]seqCall, count)
	in := make([][][]float32, count) // [call][rank]
	out := make([][][]float32, count)
	for i := range plan {
		p := seqCall{kind: rng.IntN(5), length: rng.IntN(300), wire: wires[rng.IntN(3)], op: ops[rng.IntN(3)], root: rng.IntN(g.n)}
		if i%10 == 9 {
			p.length = 20000 // a few that span several pieces
		}
		names := []string{"even", "uneven", "empty"}
		p.shards = shardings(g.n, p.length)[names[rng.IntN(3)]]
		plan[i] = p
		in[i] = make([][]float32, g.n)
		out[i] = make([][]float32, g.n)
		for r := range g.n {
			x := make([]float32, p.length)
			fill(rng, x, p.wire)
			in[i][r] = x
			out[i][r] = slices.Clone(x)
		}
		out[i] = g.place(t, out[i])
	}
	if !g.run(t, "sequential", func(ctx context.Context, r int, c collective.Communicator) error {
		for i, p := range plan {
			cl := collective.Call{Wire: p.wire}
			buf := out[i][r]
			var err error
			switch p.kind {
			case 0:
				err = c.AllReduce(ctx, buf, p.op, cl)
			case 1:
				err = c.ReduceScatter(ctx, buf, p.shards, p.op, cl)
			case 2:
				err = c.AllGather(ctx, buf, p.shards, cl)
			case 3:
				err = c.Broadcast(ctx, buf, p.root, cl)
			case 4:
				err = c.Barrier(ctx)
			}
			if err != nil {
				return fmt.Errorf("call %d: %w", i, err)
			}
		}
		return nil
	}) {
		return
	}
	for i, p := range plan {
		for r := range g.n {
			what := fmt.Sprintf("call %d (kind %d, len %d, %v, %v) rank %d", i, p.kind, p.length, p.wire, p.op, r)
			switch p.kind {
			case 0:
				newReference(in[i], p.length, p.wire, p.op).check(t, what, out[i][r], 0, p.length)
			case 1:
				newReference(in[i], p.length, p.wire, p.op).check(t, what, out[i][r], p.shards[r], p.shards[r+1])
			case 2:
				for s := range g.n {
					checkCopied(t, what, out[i][r], in[i][s], p.shards[s], p.shards[s+1], p.wire, g.n)
				}
			case 3:
				checkCopied(t, what, out[i][r], in[i][p.root], 0, p.length, p.wire, g.n)
			}
		}
	}
}

// testMismatch makes the ranks disagree — on the length, the shards, the collective — and
// requires an error on at least one rank and that every rank returns: no hang, no panic.
func testMismatch(t *testing.T, f Factory, n int) {
	cases := []struct {
		name string
		call func(ctx context.Context, r int, c collective.Communicator) error
	}{
		{"length", func(ctx context.Context, r int, c collective.Communicator) error {
			length := 1000
			if r == 0 {
				length++
			}
			return c.AllReduce(ctx, make([]float32, length), collective.Sum, collective.Call{})
		}},
		{"length-fp16", func(ctx context.Context, r int, c collective.Communicator) error {
			length := 5 * n
			if r == n-1 {
				length--
			}
			return c.AllReduce(ctx, make([]float32, length), collective.Avg, collective.Call{Wire: half.FP16})
		}},
		{"shards", func(ctx context.Context, r int, c collective.Communicator) error {
			shards := collective.EvenShards(100, n)
			if r == 1 {
				shards = shardings(n, 100)["empty"]
			}
			return c.ReduceScatter(ctx, make([]float32, 100), shards, collective.Sum, collective.Call{})
		}},
		{"wire", func(ctx context.Context, r int, c collective.Communicator) error {
			w := half.FP32
			if r == 0 {
				w = half.BF16
			}
			return c.AllReduce(ctx, make([]float32, 64), collective.Sum, collective.Call{Wire: w})
		}},
		{"collective", func(ctx context.Context, r int, c collective.Communicator) error {
			if r == 0 {
				return c.Broadcast(ctx, make([]float32, 64), 0, collective.Call{})
			}
			return c.AllReduce(ctx, make([]float32, 64), collective.Sum, collective.Call{})
		}},
		{"int64-length", func(ctx context.Context, r int, c collective.Communicator) error {
			length := 9
			if r == n-1 {
				length = 8
			}
			return c.AllReduceInt64(ctx, make([]int64, length), collective.Sum)
		}},
		{"int64-vs-float", func(ctx context.Context, r int, c collective.Communicator) error {
			if r == 0 {
				return c.AllReduceInt64(ctx, make([]int64, 32), collective.Sum)
			}
			return c.AllReduce(ctx, make([]float32, 64), collective.Sum, collective.Call{})
		}},
		{"bytes-length", func(ctx context.Context, r int, c collective.Communicator) error {
			length := 33
			if r == 1 {
				length = 0
			}
			return c.BroadcastBytes(ctx, make([]byte, length), 0)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			comms, _ := f(t, n)
			errs := all(t, comms, tc.call)
			if errors.Join(errs...) == nil {
				t.Errorf("ranks disagreed and every rank succeeded")
			}
			for r, err := range errs {
				t.Logf("rank %d: %v", r, err)
			}
		})
	}
}

// CheckGoroutines records the goroutines running qvd code now and, when t ends, fails it if
// more are still running after a grace period, with their stacks (in the manner of grpc-go's
// leak check). Goroutines of the runtime and the testing package (the fuzzing engine starts
// some) are not counted. Call it before making groups: the groups' cleanups, registered
// later, run first.
func CheckGoroutines(t testing.TB) {
	t.Helper()
	before := len(ownGoroutines())
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		for {
			now := ownGoroutines()
			if len(now) <= before {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("goroutine leak: %d goroutines running qvd code before, %d after:\n\n%s",
					before, len(now), strings.Join(now, "\n\n"))
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
	})
}

// ownGoroutines returns the stacks of the goroutines that run qvd code, other than test
// functions themselves.
func ownGoroutines() []string {
	var own []string
	for _, g := range strings.Split(stacks(), "\n\n") {
		if strings.Contains(g, "github.com/qvd/qvd/") &&
			!strings.Contains(g, "testing.tRunner") && !strings.Contains(g, "testing.fRunner") &&
			!strings.Contains(g, "collectivetest.stacks") {
			own = append(own, g)
		}
	}
	return own
}

// stacks returns every goroutine's stack, for hang and leak reports.
func stacks() string {
	b := make([]byte, 1<<20)
	b = b[:runtime.Stack(b, true)]
	return strings.TrimSpace(string(b))
}
