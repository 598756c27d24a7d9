package zero

import (
	"fmt"
	"sort"
)

// Extent is a trainable tensor in the flat space and how its gradient can be produced in
// parts: whole rows of Row elements (Row == Size: only whole). See model.Layout.Extents.
type Extent struct {
	Off, Size, Row int
}

// Bucket sizes when the config leaves them at 0. DeepSpeed's 5e8 elements suit billion-
// parameter models on GPUs and make a whole small model one bucket, which leaves nothing to
// overlap and, at stage 2, stages a full-size gradient; PyTorch DDP uses 25 MB buckets.
const (
	// autoBuckets is how many buckets a model is cut into when it is small enough: enough
	// that the first buckets are on the wire while most of the backward pass is still to run,
	// and that stage 2's two staging buckets are a sixteenth of the gradient.
	autoBuckets = 32
	// autoStagedBuckets replaces autoBuckets for the reduce at stage 2, where each bucket is
	// staged (two at a time) rather than a view of a full gradient: the staging is then a
	// thirty-second of the gradient. Halving the bucket on bench/mlp-37m.yaml took 4.3 MiB
	// off each rank's peak RSS and left the step time within the noise (docs/memory.md).
	autoStagedBuckets = 64
	// autoMinPerRank is the least a bucket puts on the wire per rank per ring step (256 KiB
	// of fp32): below it the collective's per-call latency dominates its bandwidth.
	autoMinPerRank = 1 << 16
	// autoMaxBucket caps a bucket at DDP's 25 MB of fp32: larger ones only add staging memory.
	autoMaxBucket = 25_000_000 / 4
)

// AutoBucketElems is the bucket size qvd picks for a model of elems elements trained by
// world ranks: a thirty-second of the model, at least 64 Ki elements per rank, at most 25 MB,
// never more than the model. It is the all-gather's, and the reduce's at stages 0-1.
func AutoBucketElems(elems, world int) int {
	return autoBucket(elems, world, autoBuckets)
}

// AutoReduceBucketElems is the reduce bucket size qvd picks at stage: AutoBucketElems, but a
// sixty-fourth of the model at stage 2, whose buckets are staged.
func AutoReduceBucketElems(elems, world, stage int) int {
	if stage >= 2 {
		return autoBucket(elems, world, autoStagedBuckets)
	}
	return AutoBucketElems(elems, world)
}

func autoBucket(elems, world, parts int) int {
	b := (elems + parts - 1) / parts
	b = max(b, autoMinPerRank*max(world, 1))
	b = min(b, autoMaxBucket)
	return max(1, min(b, elems))
}

// ResolveBuckets returns the reduce and all-gather bucket sizes in elements: the config's, or
// where they are 0, AutoReduceBucketElems at c.Stage and AutoBucketElems.
func (c Config) ResolveBuckets(elems, world int) (reduce, gather int) {
	reduce, gather = int(c.ReduceBucketSize), int(c.AllgatherBucketSize)
	if reduce <= 0 {
		reduce = AutoReduceBucketElems(elems, world, c.Stage)
	}
	if gather <= 0 {
		gather = AutoBucketElems(elems, world)
	}
	return min(reduce, max(elems, 1)), min(gather, max(elems, 1))
}

// cutter finds the offsets where a bucket may begin: anywhere but inside a row of an extent.
type cutter struct {
	ext []Extent // sorted by Off, disjoint
}

func newCutter(ext []Extent, size int) (*cutter, error) {
	c := &cutter{ext: append([]Extent(nil), ext...)}
	sort.Slice(c.ext, func(i, j int) bool { return c.ext[i].Off < c.ext[j].Off })
	end := 0
	for _, e := range c.ext {
		switch {
		case e.Off < end || e.Size < 0 || e.Off+e.Size > size:
			return nil, fmt.Errorf("zero: extent [%d, %d) overlaps another or leaves the %d-element space", e.Off, e.Off+e.Size, size)
		case e.Row < 1 || e.Size%e.Row != 0:
			return nil, fmt.Errorf("zero: extent [%d, %d) has rows of %d elements", e.Off, e.Off+e.Size, e.Row)
		}
		end = e.Off + e.Size
	}
	return c, nil
}

// containing returns the extent with Off < x < Off+Size, if any.
func (c *cutter) containing(x int) (Extent, bool) {
	i := sort.Search(len(c.ext), func(i int) bool { return c.ext[i].Off+c.ext[i].Size > x })
	if i == len(c.ext) || c.ext[i].Off >= x {
		return Extent{}, false
	}
	return c.ext[i], true
}

// next is the smallest allowed cut >= x.
func (c *cutter) next(x int) int {
	e, ok := c.containing(x)
	if !ok {
		return x
	}
	return e.Off + (x-e.Off+e.Row-1)/e.Row*e.Row
}

// prev is the largest allowed cut <= x.
func (c *cutter) prev(x int) int {
	e, ok := c.containing(x)
	if !ok {
		return x
	}
	return e.Off + (x-e.Off)/e.Row*e.Row
}

// BucketsAt cuts [0, Size) into buckets of at most maxElems elements that begin only where
// ext allows (tensor starts, row starts, gaps between tensors), building them from the top of
// the space, where the backward pass starts: a bucket exceeds maxElems only where one row
// does. ext nil allows every offset, as Buckets does.
func (l *Layout) BucketsAt(maxElems int, ext []Extent) ([]Bucket, error) {
	if maxElems < 1 {
		return nil, fmt.Errorf("zero: bucket size must be >= 1 element, got %d", maxElems)
	}
	c, err := newCutter(ext, l.Size)
	if err != nil {
		return nil, err
	}
	var rev []Bucket
	for hi := l.Size; hi > 0; {
		lo := c.next(max(0, hi-maxElems))
		if lo >= hi {
			lo = c.prev(hi - 1)
		}
		rev = append(rev, Bucket{Lo: lo, Hi: hi, Shards: l.clip(lo, hi)})
		hi = lo
	}
	out := make([]Bucket, len(rev))
	for i, b := range rev {
		out[len(rev)-1-i] = b
	}
	return out, nil
}
