package data

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
)

// Permutation fills dst with a permutation of 0..len(dst)-1 that depends only on (seed,
// epoch), so every rank of every run computes the same one. It is a Fisher–Yates shuffle
// driven by math/rand/v2's PCG (PCG-DXSM, whose output is fixed by its specification). The
// epoch goes through a SplitMix64 finaliser before seeding so that consecutive epochs start
// from unrelated states, and bounded draws use Lemire's multiply-and-reject method, written
// here rather than taken from rand.Rand so the sequence cannot change with the Go release.
// dst must hold fewer than 2^31 elements; it allocates nothing.
func Permutation(dst []int32, seed uint64, epoch int) {
	for i := range dst {
		dst[i] = int32(i)
	}
	var src rand.PCG
	src.Seed(seed, mix64(uint64(epoch)))
	for i := len(dst) - 1; i > 0; i-- {
		j := uint64n(&src, uint64(i)+1)
		dst[i], dst[j] = dst[j], dst[i]
	}
}

// uint64n returns a uniform value in [0, n), n > 0, without modulo bias (D. Lemire, "Fast
// Random Integer Generation in an Interval", ACM TOMACS 2019): the high word of a 64x64-bit
// product is uniform except for a sliver of low words, which are rejected.
func uint64n(src *rand.PCG, n uint64) uint64 {
	hi, lo := bits.Mul64(src.Uint64(), n)
	if lo < n {
		threshold := -n % n // 2^64 mod n
		for lo < threshold {
			hi, lo = bits.Mul64(src.Uint64(), n)
		}
	}
	return hi
}

// mix64 is the SplitMix64 finaliser (Steele, Lea and Flood, "Fast Splittable Pseudorandom
// Number Generators", OOPSLA 2014): a bijection that spreads a one-bit change in x over the
// whole word.
func mix64(x uint64) uint64 {
	x ^= x >> 30
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 27
	x *= 0x94d049bb133111eb
	x ^= x >> 31
	return x
}

// MicroBatch returns the positions in the epoch permutation perm that rank `rank` of `world`
// uses for micro-batch j of the step whose first sample is at position offset, with
// micro-batch size m: perm[offset + j*world*m + rank*m :][:m]. The ranks' slices for one j are
// adjacent, so together they are exactly the micro-batch j of size world*m that a single
// worker would use. The result aliases perm and has capacity m, so appending to it cannot
// overwrite the next rank's positions.
//
// The arguments come from the trainer's own step arithmetic (offset = step*globalBatch with
// StepsPerEpoch steps per epoch), so a range outside perm is a bug in the caller and panics.
func MicroBatch(perm []int32, offset, j, world, rank, m int) []int32 {
	if world < 1 || rank < 0 || rank >= world || m < 1 || offset < 0 || j < 0 {
		panic(fmt.Sprintf("data: MicroBatch(offset=%d, j=%d, world=%d, rank=%d, m=%d): invalid arguments", offset, j, world, rank, m))
	}
	start := offset + (j*world+rank)*m
	if start < 0 || start > len(perm)-m {
		panic(fmt.Sprintf("data: MicroBatch(offset=%d, j=%d, world=%d, rank=%d, m=%d): positions [%d, %d) outside the permutation of %d", offset, j, world, rank, m, start, start+m, len(perm)))
	}
	return perm[start : start+m : start+m]
}

// StepsPerEpoch is the number of whole global batches in n samples: floor(n / globalBatch).
// The last partial batch is dropped (drop_last), so every step has the same size on every
// rank. It is 0 when globalBatch < 1.
func StepsPerEpoch(n, globalBatch int) int {
	if globalBatch < 1 || n < 0 {
		return 0
	}
	return n / globalBatch
}
