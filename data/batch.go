package data

import (
	"fmt"
)

// Batch is a caller-owned buffer of samples, allocated once and refilled every step.
type Batch struct {
	X          []float32 // Cap*SampleSize normalised values, row-major; only the first N rows are valid
	Y          []int32   // Cap labels; only the first N are valid
	N          int       // rows filled by the last Fill or FillRange
	Cap        int       // rows the buffers hold
	SampleSize int       // values per row (Dataset.SampleSize)
}

// NewBatch allocates a batch of capacity rows of sampleSize values. Both must be positive;
// they come from validated configuration, so anything else is a bug in the caller and panics.
func NewBatch(capacity, sampleSize int) *Batch {
	if capacity < 1 || sampleSize < 1 {
		panic(fmt.Sprintf("data: NewBatch(%d, %d): capacity and sample size must be positive", capacity, sampleSize))
	}
	return &Batch{
		X:          make([]float32, capacity*sampleSize),
		Y:          make([]int32, capacity),
		Cap:        capacity,
		SampleSize: sampleSize,
	}
}

// Fill writes the normalised pixels and labels of samples idx into the first len(idx) rows of
// b, zeroes the remaining rows and labels, and sets b.N. It checks everything before writing,
// so on error b is unchanged. It allocates nothing.
func (d *Dataset) Fill(b *Batch, idx []int32, norm Normalize) error {
	ss, err := d.checkFill(b, len(idx), norm)
	if err != nil {
		return err
	}
	for r, i := range idx {
		if i < 0 || int(i) >= d.N {
			return fmt.Errorf("data: fill batch: sample index %d at position %d is outside [0, %d)", i, r, d.N)
		}
	}
	lut := normTable(norm)
	x := b.X[:len(idx)*ss]
	for r, i := range idx {
		src := d.Images[int(i)*ss:][:ss]
		dst := x[r*ss:][:ss]
		for k, p := range src {
			dst[k] = lut[p]
		}
		b.Y[r] = int32(d.Labels[i])
	}
	b.finish(len(idx))
	return nil
}

// FillRange writes samples start..start+count-1 into b, as Fill does; evaluation walks the
// test set with it. It allocates nothing.
func (d *Dataset) FillRange(b *Batch, start, count int, norm Normalize) error {
	ss, err := d.checkFill(b, count, norm)
	if err != nil {
		return err
	}
	if start < 0 || count < 0 || start > d.N-count {
		return fmt.Errorf("data: fill batch: samples [%d, %d) are outside [0, %d)", start, start+count, d.N)
	}
	lut := normTable(norm)
	src := d.Images[start*ss : (start+count)*ss]
	dst := b.X[:len(src)]
	for k, p := range src {
		dst[k] = lut[p]
	}
	for r, l := range d.Labels[start : start+count] {
		b.Y[r] = int32(l)
	}
	b.finish(count)
	return nil
}

// checkFill validates everything Fill and FillRange index with, so a hand-built Dataset or
// Batch with inconsistent fields yields an error instead of a panic. It returns the sample
// size.
func (d *Dataset) checkFill(b *Batch, rows int, norm Normalize) (int, error) {
	ss := d.SampleSize()
	switch {
	case ss < 1 || d.N < 0 || len(d.Images) != d.N*ss || len(d.Labels) != d.N:
		return 0, fmt.Errorf("data: fill batch: inconsistent dataset: %d samples of %dx%dx%d with %d pixels and %d labels", d.N, d.C, d.H, d.W, len(d.Images), len(d.Labels))
	case b.SampleSize != ss:
		return 0, fmt.Errorf("data: fill batch: batch rows hold %d values, samples have %d", b.SampleSize, ss)
	case b.Cap < 0 || len(b.X) != b.Cap*ss || len(b.Y) != b.Cap:
		return 0, fmt.Errorf("data: fill batch: inconsistent batch: capacity %d with %d values and %d labels", b.Cap, len(b.X), len(b.Y))
	case rows > b.Cap:
		return 0, fmt.Errorf("data: fill batch: %d samples do not fit a batch of capacity %d", rows, b.Cap)
	}
	if err := norm.Validate(); err != nil {
		return 0, fmt.Errorf("data: fill batch: normalize.%w", err)
	}
	return ss, nil
}

// finish zeroes the rows after n, so stale samples from an earlier, fuller batch can never
// leak into a computation that reads the whole buffer, and records n.
func (b *Batch) finish(n int) {
	clear(b.X[n*b.SampleSize:])
	clear(b.Y[n:])
	b.N = n
}

// normTable maps each of the 256 pixel values to its normalised value. A lookup per pixel is
// cheaper than the arithmetic, and computing each entry in float64 makes the result the
// correctly rounded value of ((p/255) - mean) / std. The table lives on the stack.
func normTable(norm Normalize) [256]float32 {
	var t [256]float32
	mean, std := float64(norm.Mean), float64(norm.Std)
	for p := range t {
		t[p] = float32((float64(p)/255 - mean) / std)
	}
	return t
}
