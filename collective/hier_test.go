package collective_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
	"github.com/qvd/qvd/internal/half"
)

// hierWorld builds a world of hierarchical communicators in which global rank g is on host
// hostOf[g]: an in-process group per host for the local rings and one per local rank for
// the cross rings, as a deployment has shared memory within hosts and TCP across them.
// kill(g) kills rank g in both of its groups, as a crashed process would vanish from both.
func hierWorld(t testing.TB, hostOf []int, cfg collective.Config) ([]*collective.Hierarchical, func(int)) {
	t.Helper()
	n := len(hostOf)
	ids := make([]string, n)
	for g, h := range hostOf {
		ids[g] = fmt.Sprintf("host-%d", h)
	}
	topos := make([]collective.Topology, n)
	for g := range n {
		tp, err := collective.NewTopology(ids, g)
		if err != nil {
			t.Fatal(err)
		}
		topos[g] = tp
	}
	nh, nl := len(topos[0].Hosts), len(topos[0].Local)
	localNets, localTs := make([]*collective.InprocNet, nh), make([][]collective.Transport, nh)
	crossNets, crossTs := make([]*collective.InprocNet, nl), make([][]collective.Transport, nl)
	for c := range nh {
		localNets[c], localTs[c] = collective.NewInproc(nl, uint64(c+1))
	}
	for l := range nl {
		crossNets[l], crossTs[l] = collective.NewInproc(nh, uint64(100+l))
	}
	comms := make([]*collective.Hierarchical, n)
	t.Cleanup(func() {
		for _, c := range comms {
			if c != nil {
				c.Close()
			}
		}
		for _, ts := range append(slices.Clone(localTs), crossTs...) {
			for _, tr := range ts {
				tr.Close()
			}
		}
	})
	for g, tp := range topos {
		local, err := collective.NewRing(localTs[tp.HostOf[g]][tp.LocalRank], cfg)
		if err != nil {
			t.Fatal(err)
		}
		cross, err := collective.NewRing(crossTs[tp.LocalRank][tp.CrossRank], cfg)
		if err != nil {
			t.Fatal(err)
		}
		if comms[g], err = collective.NewHierarchical(local, cross, tp); err != nil {
			t.Fatalf("rank %d: %v", g, err)
		}
	}
	kill := func(g int) {
		tp := topos[g]
		localNets[tp.HostOf[g]].Kill(tp.LocalRank)
		crossNets[tp.LocalRank].Kill(tp.CrossRank)
	}
	return comms, kill
}

// hierFactory makes the suite's groups with the host layout shape(n).
func hierFactory(cfg collective.Config, shape func(n int) []int) collectivetest.Factory {
	return func(t *testing.T, n int) ([]collective.Communicator, func(int)) {
		hs, kill := hierWorld(t, shape(n), cfg)
		comms := make([]collective.Communicator, n)
		for g, h := range hs {
			comms[g] = h
		}
		return comms, kill
	}
}

// Host layouts: blocks of per consecutive ranks per host; hosts dealt round robin (the
// layout that needs no staging copies); and an arbitrary one.
func blocks(per int) func(int) []int {
	return func(n int) []int {
		s := make([]int, n)
		for g := range s {
			s[g] = g / per
		}
		return s
	}
}

func hostsOf(hosts int) func(int) []int {
	return func(n int) []int { return blocks((n + hosts - 1) / hosts)(n) }
}

func roundRobin(hosts int) func(int) []int {
	return func(n int) []int {
		s := make([]int, n)
		for g := range s {
			s[g] = g % hosts
		}
		return s
	}
}

func scrambled(int) []int { return []int{1, 0, 2, 1, 0, 2} } // 3 hosts × 2, first ranks 0, 1, 2

// TestHierarchicalConformance runs the shared suite over hierarchical worlds of several
// shapes (H hosts × L ranks), including the degenerate 1×N and N×1 and non-contiguous ones.
func TestHierarchicalConformance(t *testing.T) {
	cfg := testConfig(10 * time.Second)
	cases := []struct {
		name  string
		shape func(int) []int
		sizes []int
	}{
		{"2hosts", hostsOf(2), []int{4, 6}},       // 2×2, 2×3
		{"2perhost", blocks(2), []int{2, 6}},      // 1×2, 3×2
		{"roundrobin", roundRobin(2), []int{4}},   // 2×2, no staging copies
		{"scrambled", scrambled, []int{6}},        // 3×2, hosts interleaved irregularly
		{"onehost", blocks(1 << 10), []int{1, 3}}, // 1×N
		{"oneperhost", blocks(1), []int{3}},       // N×1
	}
	if testing.Short() {
		cases = cases[:4]
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			collectivetest.RunSizes(t, hierFactory(cfg, tc.shape), tc.sizes...)
		})
	}
}

// TestHierarchicalFaults: a dead, stalled or failing rank is named by its global rank on
// every other rank, also on ranks that only hear of it through the other group.
func TestHierarchicalFaults(t *testing.T) {
	const timeout = 300 * time.Millisecond
	cfg := testConfig(timeout)
	shapes := map[string]func(int) []int{
		// N=4 is 2×2; 2 and 3 are 1×N (a flat ring).
		"blocks": func(n int) []int {
			if n == 4 {
				return blocks(2)(n)
			}
			return blocks(n)(n)
		},
		"roundrobin": func(n int) []int {
			if n == 4 {
				return roundRobin(2)(n)
			}
			return blocks(1)(n)
		},
	}
	for name, shape := range shapes {
		t.Run(name, func(t *testing.T) { collectivetest.RunFaults(t, hierFactory(cfg, shape), timeout) })
	}
}

// TestHierarchicalBlame kills each rank of a 2×3 and a 3×2 world in turn, before and during
// each kind of call: every survivor fails quickly with a *PeerError naming the dead rank
// (a broadcast may complete on ranks that do not need the dead one; those may succeed).
func TestHierarchicalBlame(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const timeout = 2 * time.Second
	cfg := testConfig(timeout)
	calls := map[string]func(ctx context.Context, c collective.Communicator, buf []float32) error{
		"all-reduce": func(ctx context.Context, c collective.Communicator, buf []float32) error {
			return c.AllReduce(ctx, buf, collective.Avg, collective.Call{})
		},
		"reduce-scatter": func(ctx context.Context, c collective.Communicator, buf []float32) error {
			return c.ReduceScatter(ctx, buf, collective.EvenShards(len(buf), c.Size()), collective.Sum, collective.Call{Tag: 5})
		},
		"all-gather": func(ctx context.Context, c collective.Communicator, buf []float32) error {
			return c.AllGather(ctx, buf, collective.EvenShards(len(buf), c.Size()), collective.Call{Wire: half.BF16})
		},
		"broadcast": func(ctx context.Context, c collective.Communicator, buf []float32) error {
			return c.Broadcast(ctx, buf, 1, collective.Call{})
		},
		"barrier": func(ctx context.Context, c collective.Communicator, buf []float32) error {
			return c.Barrier(ctx)
		},
	}
	for _, shape := range [][]int{{0, 0, 0, 1, 1, 1}, {0, 1, 2, 0, 1, 2}, scrambled(6)} {
		for dead := range shape {
			for name, call := range calls {
				t.Run(fmt.Sprintf("%v/dead=%d/%s", shape, dead, name), func(t *testing.T) {
					comms, kill := hierWorld(t, shape, cfg)
					kill(dead)
					start := time.Now()
					errs := runAll(comms, func(ctx context.Context, g int, c *collective.Hierarchical) error {
						if g == dead {
							return nil
						}
						return call(ctx, c, make([]float32, 5000))
					})
					if el := time.Since(start); el > timeout/2 {
						t.Errorf("the ranks took %v to fail, want well under the timeout %v", el, timeout)
					}
					failed := 0
					for g, err := range errs {
						var pe *collective.PeerError
						switch {
						case g == dead || err == nil && name == "broadcast":
						case !errors.As(err, &pe) || pe.Rank != dead:
							t.Errorf("rank %d: got %v, want a *PeerError naming rank %d", g, err, dead)
						default:
							failed++
						}
					}
					if failed == 0 {
						t.Errorf("every rank succeeded with rank %d dead", dead)
					}
				})
			}
		}
	}
}

// runAll runs fn on every rank at once, with a deadline, and returns each rank's error.
func runAll(comms []*collective.Hierarchical, fn func(ctx context.Context, g int, c *collective.Hierarchical) error) []error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for g, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[g] = fn(ctx, g, c)
		}()
	}
	wg.Wait()
	return errs
}

// TestHierarchicalVsFlat compares a hierarchical world with a flat ring of the same size on
// the same inputs. Sums of arbitrary fp32 values differ only by the order of addition, each
// within (N-1)·2⁻²⁴·Σ|x| of the exact sum, so the two within twice that; every rank of the
// hierarchical world ends bit-identical. Copies (all-gather) and exact sums (integers) must
// match the flat ring bit for bit, with uneven and empty shards.
func TestHierarchicalVsFlat(t *testing.T) {
	cfg := testConfig(10 * time.Second)
	const n, length = 6, 20011
	rings, _, _ := inprocGroup(t, n, cfg)
	flat := make([]collective.Communicator, n)
	for g, r := range rings {
		flat[g] = r
	}
	for _, shape := range [][]int{blocks(3)(n), blocks(2)(n), scrambled(n), roundRobin(3)(n)} {
		hs, _ := hierWorld(t, shape, cfg)
		hier := make([]collective.Communicator, n)
		for g, h := range hs {
			hier[g] = h
		}
		t.Run(fmt.Sprint(shape), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(len(shape)), uint64(shape[1])))
			// Arbitrary values of mixed signs and magnitudes: order matters.
			in := make([][]float32, n)
			var worst float64
			for g := range in {
				in[g] = make([]float32, length)
				for i := range in[g] {
					in[g][i] = float32(rng.NormFloat64() * math.Exp2(float64(rng.IntN(20)-10)))
				}
			}
			got := both(t, flat, hier, in, func(ctx context.Context, c collective.Communicator, buf []float32) error {
				return c.AllReduce(ctx, buf, collective.Sum, collective.Call{})
			})
			for g := 1; g < n; g++ {
				if !bitsEqual(got.hier[g], got.hier[0]) {
					t.Fatalf("all-reduce: rank %d's result differs from rank 0's", g)
				}
			}
			for i := range length {
				var abs float64
				for g := range n {
					abs += math.Abs(float64(in[g][i]))
				}
				d := math.Abs(float64(got.hier[0][i]) - float64(got.flat[0][i]))
				if tol := 2 * (n - 1) * 0x1p-24 * abs; d > tol {
					t.Fatalf("all-reduce element %d: hierarchical %v, flat %v: differ by %g > %g", i, got.hier[0][i], got.flat[0][i], d, tol)
				}
				if abs > 0 {
					worst = max(worst, d/abs)
				}
			}
			t.Logf("all-reduce fp32: largest |hierarchical - flat| / Σ|x| = %.3g (bound %.3g)", worst, 2*(n-1)*0x1p-24)

			// Integer inputs: exact sums, so every result must be the flat ring's bits.
			for g := range in {
				for i := range in[g] {
					in[g][i] = float32(rng.IntN(2001) - 1000)
				}
			}
			got = both(t, flat, hier, in, func(ctx context.Context, c collective.Communicator, buf []float32) error {
				return c.AllReduce(ctx, buf, collective.Avg, collective.Call{})
			})
			checkSame(t, "all-reduce avg", got, nil)
			for sname, shards := range testShardings(rng, n, length) {
				got = both(t, flat, hier, in, func(ctx context.Context, c collective.Communicator, buf []float32) error {
					return c.ReduceScatter(ctx, buf, shards, collective.Sum, collective.Call{Tag: 9})
				})
				checkSame(t, "reduce-scatter "+sname, got, shards)
				for _, wire := range []half.Format{half.FP32, half.FP16} {
					got = both(t, flat, hier, in, func(ctx context.Context, c collective.Communicator, buf []float32) error {
						return c.AllGather(ctx, buf, shards, collective.Call{Wire: wire})
					})
					checkSame(t, fmt.Sprintf("all-gather %s %v", sname, wire), got, nil)
				}
			}
		})
	}
}

func testShardings(rng *rand.Rand, n, length int) map[string]collective.Shards {
	uneven := make(collective.Shards, n+1)
	for i := 1; i < n; i++ {
		uneven[i] = rng.IntN(length + 1)
	}
	uneven[n] = length
	slices.Sort(uneven)
	empty := make(collective.Shards, n+1) // only rank 2 owns anything
	for i := 3; i <= n; i++ {
		empty[i] = length
	}
	return map[string]collective.Shards{"even": collective.EvenShards(length, n), "uneven": uneven, "empty": empty}
}

type results struct{ flat, hier [][]float32 }

// both runs fn on the flat group and the hierarchical one, each rank on a copy of in[rank].
func both(t *testing.T, flat, hier []collective.Communicator, in [][]float32, fn func(ctx context.Context, c collective.Communicator, buf []float32) error) results {
	t.Helper()
	var res results
	for _, side := range []struct {
		comms []collective.Communicator
		out   *[][]float32
	}{{flat, &res.flat}, {hier, &res.hier}} {
		bufs := make([][]float32, len(in))
		for g := range in {
			bufs[g] = slices.Clone(in[g])
		}
		errs := make([]error, len(in))
		var wg sync.WaitGroup
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		for g, c := range side.comms {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[g] = fn(ctx, c, bufs[g])
			}()
		}
		wg.Wait()
		cancel()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		*side.out = bufs
	}
	return res
}

// checkSame requires the hierarchical results to be the flat ring's bits: everywhere, or in
// each rank's own shard when shards is given (the rest of a reduce-scatter is scratch).
func checkSame(t *testing.T, what string, got results, shards collective.Shards) {
	t.Helper()
	for g := range got.flat {
		f, h := got.flat[g], got.hier[g]
		if shards != nil {
			f, h = f[shards[g]:shards[g+1]], h[shards[g]:shards[g+1]]
		}
		if !bitsEqual(f, h) {
			t.Errorf("%s: rank %d differs from the flat ring", what, g)
		}
	}
}

func bitsEqual(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// TestNewHierarchicalRefuses: a non-uniform topology, or communicators that do not match the
// topology, are errors.
func TestNewHierarchicalRefuses(t *testing.T) {
	cfg := testConfig(time.Second)
	// ring returns rank r of a fresh group of size (a Transport serves one Ring only).
	ring := func(size, r int) collective.Communicator {
		_, ts := collective.NewInproc(size, 1)
		ring, err := collective.NewRing(ts[r], cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			ring.Close()
			for _, tr := range ts {
				tr.Close()
			}
		})
		return ring
	}
	uneven, _ := collective.NewTopology([]string{"a", "a", "b"}, 0)
	twoByTwo, _ := collective.NewTopology([]string{"a", "a", "b", "b"}, 0)
	for name, tc := range map[string]struct {
		local, cross collective.Communicator
		topo         collective.Topology
	}{
		"uneven":            {ring(2, 0), ring(2, 0), uneven},
		"local size":        {ring(1, 0), ring(2, 0), twoByTwo},
		"cross rank":        {ring(2, 0), ring(2, 1), twoByTwo},
		"cross for local 1": {ring(2, 1), ring(2, 0), twoByTwo},
		"empty topology":    {ring(1, 0), ring(1, 0), collective.Topology{}},
		"rank outside":      {ring(1, 0), ring(1, 0), collective.Topology{Rank: 1, Size: 1, Uniform: true}},
	} {
		if _, err := collective.NewHierarchical(tc.local, tc.cross, tc.topo); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	good, err := collective.NewHierarchical(ring(2, 0), ring(2, 0), twoByTwo)
	if err != nil {
		t.Fatalf("2x2: %v", err)
	}
	if good.Rank() != 0 || good.Size() != 4 {
		t.Errorf("2x2: rank %d of %d", good.Rank(), good.Size())
	}
	if err := errors.Join(good.Close(), good.Close()); err != nil {
		t.Errorf("Close twice: %v", err)
	}
	if err := good.Barrier(context.Background()); !errors.Is(err, collective.ErrClosed) {
		t.Errorf("Barrier after Close: %v, want ErrClosed", err)
	}
}
