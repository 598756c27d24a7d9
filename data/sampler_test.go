package data

import (
	"fmt"
	"math"
	"slices"
	"testing"
)

func isPermutation(p []int32) bool {
	seen := make([]bool, len(p))
	for _, v := range p {
		if v < 0 || int(v) >= len(p) || seen[v] {
			return false
		}
		seen[v] = true
	}
	return true
}

func TestPermutationDeterministic(t *testing.T) {
	for _, n := range []int{0, 1, 2, 17, 60000} {
		a, b := make([]int32, n), make([]int32, n)
		Permutation(a, 42, 3)
		Permutation(b, 42, 3)
		if !slices.Equal(a, b) {
			t.Fatalf("n=%d: two calls differ", n)
		}
		if !isPermutation(a) {
			t.Fatalf("n=%d: not a permutation", n)
		}
	}
	// Every epoch and every seed gives a different order.
	n := 60000
	seen := map[string]bool{}
	p := make([]int32, n)
	for _, seed := range []uint64{0, 1, 42} {
		for epoch := range 4 {
			Permutation(p, seed, epoch)
			k := fmt.Sprint(p[:32])
			if seen[k] {
				t.Fatalf("seed %d epoch %d repeats an earlier order", seed, epoch)
			}
			seen[k] = true
		}
	}
}

// TestPermutationGolden pins the sequence: checkpoints resume by (seed, epoch, step), so a
// change here would silently change which samples a resumed run sees.
func TestPermutationGolden(t *testing.T) {
	p := make([]int32, 10)
	Permutation(p, 1, 0)
	want := []int32{7, 6, 1, 3, 2, 4, 8, 9, 0, 5}
	if !slices.Equal(p, want) {
		t.Fatalf("Permutation(10, seed 1, epoch 0) = %#v, want %#v", p, want)
	}
}

// TestPermutationUniform checks the shuffle is unbiased: over 24000 epochs each of the 24
// orders of 4 elements appears about 1000 times. The bound is a chi-square statistic far
// beyond any plausible value for 23 degrees of freedom (p < 1e-6 at 62.4) but small enough to
// catch a modulo-biased or off-by-one Fisher–Yates.
func TestPermutationUniform(t *testing.T) {
	counts := map[[4]int32]int{}
	var p [4]int32
	const epochs = 24000
	for e := range epochs {
		Permutation(p[:], 7, e)
		counts[p]++
	}
	if len(counts) != 24 {
		t.Fatalf("saw %d distinct orders of 4, want 24", len(counts))
	}
	chi2 := 0.0
	for _, c := range counts {
		d := float64(c) - epochs/24
		chi2 += d * d / (epochs / 24)
	}
	if chi2 > 62.4 || math.IsNaN(chi2) {
		t.Fatalf("chi-square %.1f over 24 orders: shuffle is biased (counts %v)", chi2, counts)
	}
}

func TestPermutationDoesNotAllocate(t *testing.T) {
	p := make([]int32, 1000)
	if a := testing.AllocsPerRun(10, func() { Permutation(p, 1, 2) }); a != 0 {
		t.Fatalf("Permutation allocates %v times", a)
	}
}

// TestMicroBatchUnionOverRanks is the property the trainer relies on: for every step of an
// epoch and every micro-batch j, the ranks' micro-batches concatenated in rank order are the
// single worker's micro-batch j of size world*m, and one epoch uses each position at most once.
func TestMicroBatchUnionOverRanks(t *testing.T) {
	const n = 1000
	perm := make([]int32, n)
	Permutation(perm, 5, 1)
	for world := 1; world <= 4; world++ {
		for _, m := range []int{1, 3, 8} {
			for _, accum := range []int{1, 2, 3} {
				global := world * m * accum
				steps := StepsPerEpoch(n, global)
				used := make([]bool, n)
				for s := range steps {
					offset := s * global
					for j := range accum {
						var union []int32
						for rank := range world {
							mb := MicroBatch(perm, offset, j, world, rank, m)
							if len(mb) != m || cap(mb) != m {
								t.Fatalf("world %d m %d: len %d cap %d", world, m, len(mb), cap(mb))
							}
							union = append(union, mb...)
						}
						single := MicroBatch(perm, offset, j, 1, 0, world*m)
						if !slices.Equal(union, single) {
							t.Fatalf("world %d m %d accum %d step %d j %d: union %v, single worker %v", world, m, accum, s, j, union, single)
						}
						for _, v := range union {
							if used[v] {
								t.Fatalf("world %d m %d accum %d: sample %d used twice in an epoch", world, m, accum, v)
							}
							used[v] = true
						}
					}
				}
				if c := count(used); c != steps*global || c > n || n-c >= global {
					t.Fatalf("world %d m %d accum %d: %d samples used, want %d (drop_last)", world, m, accum, c, steps*global)
				}
			}
		}
	}
}

func count(b []bool) int {
	c := 0
	for _, v := range b {
		if v {
			c++
		}
	}
	return c
}

func TestMicroBatchPanicsOutOfRange(t *testing.T) {
	perm := make([]int32, 10)
	for _, c := range [][5]int{
		{8, 0, 1, 0, 3},  // runs past the end
		{0, 0, 2, 2, 1},  // rank >= world
		{0, 0, 0, 0, 1},  // world 0
		{0, 0, 1, 0, 0},  // m 0
		{-1, 0, 1, 0, 1}, // negative offset
		{0, 5, 2, 1, 1},  // j too large
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("MicroBatch(offset=%d, j=%d, world=%d, rank=%d, m=%d) did not panic", c[0], c[1], c[2], c[3], c[4])
				}
			}()
			MicroBatch(perm, c[0], c[1], c[2], c[3], c[4])
		}()
	}
	if got := MicroBatch(perm, 7, 0, 1, 0, 3); len(got) != 3 {
		t.Fatalf("last full micro-batch: %v", got)
	}
}

func TestStepsPerEpoch(t *testing.T) {
	for _, c := range [][3]int{{60000, 256, 234}, {60000, 60000, 1}, {59999, 60000, 0}, {10, 3, 3}, {10, 0, 0}, {10, -1, 0}, {0, 4, 0}} {
		if got := StepsPerEpoch(c[0], c[1]); got != c[2] {
			t.Errorf("StepsPerEpoch(%d, %d) = %d, want %d", c[0], c[1], got, c[2])
		}
	}
}
