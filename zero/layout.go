package zero

import (
	"fmt"

	"github.com/qvd/qvd/collective"
)

// ShardAlign is the element alignment of shard boundaries: 16 float32 = 64 bytes, one cache
// line, so two ranks' optimizer passes never share a line and vector loops start aligned
// (the same alignment as the model's tensor offsets).
const ShardAlign = 16

// Layout splits the flat parameter space [0, Size) among World ranks: rank r owns
// [Shards[r], Shards[r+1]). Boundaries are multiples of ShardAlign (except the end), shards
// are as equal as that allows, and with more ranks than aligned blocks some shards are empty.
type Layout struct {
	Size   int
	World  int
	Shards collective.Shards
}

// NewLayout partitions size elements among world ranks.
func NewLayout(size, world int) (*Layout, error) {
	if size < 0 {
		return nil, fmt.Errorf("zero: negative size %d", size)
	}
	if world < 1 {
		return nil, fmt.Errorf("zero: world size must be >= 1, got %d", world)
	}
	l := &Layout{Size: size, World: world, Shards: make(collective.Shards, world+1)}
	blocks := (size + ShardAlign - 1) / ShardAlign
	for r := 1; r <= world; r++ {
		// Rank r starts at the r/world-th aligned block: balanced to within one block.
		b := blocks * r / world
		l.Shards[r] = min(size, b*ShardAlign)
	}
	return l, nil
}

// Shard returns rank's range [lo, hi).
func (l *Layout) Shard(rank int) (lo, hi int) { return l.Shards[rank], l.Shards[rank+1] }

// Len is the length of rank's shard.
func (l *Layout) Len(rank int) int { return l.Shards[rank+1] - l.Shards[rank] }

// MaxLen is the length of the largest shard.
func (l *Layout) MaxLen() int {
	m := 0
	for r := 0; r < l.World; r++ {
		m = max(m, l.Len(r))
	}
	return m
}

// Bucket is a contiguous range of the flat space reduced in one collective call; Shards are
// the ranks' shards clipped to it (relative to Lo), so a bucket respects shard boundaries: each
// rank receives exactly the part of the bucket that falls in its shard.
type Bucket struct {
	Lo, Hi int
	Shards collective.Shards
}

// Buckets cuts [0, Size) into consecutive buckets of at most maxElems elements (the
// reduce_bucket_size of DeepSpeed, the bucket_cap of DDP).
func (l *Layout) Buckets(maxElems int) ([]Bucket, error) {
	if maxElems < 1 {
		return nil, fmt.Errorf("zero: bucket size must be >= 1 element, got %d", maxElems)
	}
	var out []Bucket
	for lo := 0; lo < l.Size; lo += maxElems {
		hi := min(l.Size, lo+maxElems)
		out = append(out, Bucket{Lo: lo, Hi: hi, Shards: l.clip(lo, hi)})
	}
	return out, nil
}

// clip returns the shards intersected with [lo, hi), relative to lo.
func (l *Layout) clip(lo, hi int) collective.Shards {
	s := make(collective.Shards, l.World+1)
	for r := 0; r <= l.World; r++ {
		s[r] = min(max(l.Shards[r], lo), hi) - lo
	}
	return s
}

// Overlap returns the intersection of [aLo, aHi) and [bLo, bHi), and whether it is non-empty:
// used to re-split a checkpoint's shards at another world size.
func Overlap(aLo, aHi, bLo, bHi int) (lo, hi int, ok bool) {
	lo, hi = max(aLo, bLo), min(aHi, bHi)
	return lo, hi, lo < hi
}
