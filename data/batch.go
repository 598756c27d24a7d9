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
// so on a bad argument b is unchanged. For a dataset held in memory with one mapping for all
// channels (every idx dataset) it allocates nothing; a dataset read from files (image-folder)
// decodes each sample, and a sample that cannot be decoded is handled as data.on_error says
// (see FillAugmented). Fill never augments.
func (d *Dataset) Fill(b *Batch, idx []int32, norm Normalize) error {
	return d.fill(b, idx, norm, nil)
}

// FillAugmented is Fill for training: where the dataset was loaded with data.augment, each
// sample is randomly cropped and flipped, as drawn from (at, sample index) alone, so every
// rank, every world size and every resume transform a sample the same way in an epoch.
//
// A sample whose file cannot be read or decoded fails the fill with an error naming the file
// under data.on_error: fail; under skip (the default) its row is filled with the next
// sample of the split that can be read (deterministically, so ranks agree), the file is
// counted (Skipped) and reported once through Options.Warn.
func (d *Dataset) FillAugmented(b *Batch, idx []int32, norm Normalize, at Draw) error {
	return d.fill(b, idx, norm, &at)
}

func (d *Dataset) fill(b *Batch, idx []int32, norm Normalize, at *Draw) error {
	ss, err := d.checkFill(b, len(idx), norm)
	if err != nil {
		return err
	}
	for r, i := range idx {
		if i < 0 || int(i) >= d.N {
			return fmt.Errorf("data: fill batch: sample index %d at position %d is outside [0, %d)", i, r, d.N)
		}
	}
	augment := at != nil && d.aug.Enabled()
	if d.Images == nil || augment || len(norm.PerChannel) > 0 || d.rows != nil {
		return d.fillGeneral(b, idx, norm, at, augment)
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

// fillGeneral is fill for samples read from files or held as float32, per-channel
// normalisation or augmentation. Its scratch buffers are allocated per call: decoding
// allocates anyway, and a fill may run on several goroutines at once.
func (d *Dataset) fillGeneral(b *Batch, idx []int32, norm Normalize, at *Draw, augment bool) error {
	ss, plane := d.SampleSize(), d.H*d.W
	var luts [MaxChannels][256]float32
	var chans [MaxChannels]Normalize
	for c := range d.C {
		chans[c] = norm.channel(c)
		luts[c] = normTable(chans[c])
	}
	var px, aug []uint8
	var fx []float32
	if d.floats == nil && d.Images == nil {
		px = make([]uint8, ss)
	}
	if augment {
		if d.floats != nil {
			fx = make([]float32, ss)
		} else {
			aug = make([]uint8, ss)
		}
	}
	for r, i32 := range idx {
		i := int(i32)
		dst := b.X[r*ss:][:ss]
		if d.floats != nil {
			src := d.floats[d.row(i)*ss:][:ss]
			if augment {
				apply(fx, src, d.C, d.H, d.W, d.aug.CropPadding, d.aug.draw(*at, i))
				src = fx
			}
			for c := range d.C {
				mean, std := float64(chans[c].Mean), float64(chans[c].Std)
				for k, v := range src[c*plane:][:plane] {
					dst[c*plane+k] = float32((float64(v) - mean) / std)
				}
			}
			b.Y[r] = int32(d.Labels[i])
			continue
		}
		var src []uint8
		if d.Images != nil {
			src = d.Images[d.row(i)*ss:][:ss]
		} else {
			j, err := d.readGood(i, px)
			if err != nil {
				b.finish(0)
				return err
			}
			i, src = j, px
		}
		if augment {
			apply(aug, src, d.C, d.H, d.W, d.aug.CropPadding, d.aug.draw(*at, i))
			src = aug
		}
		for c := range d.C {
			lut := &luts[c]
			out := dst[c*plane:][:plane]
			for k, p := range src[c*plane:][:plane] {
				out[k] = lut[p]
			}
		}
		b.Y[r] = int32(d.Labels[i])
	}
	b.finish(len(idx))
	return nil
}

// readGood reads sample i into dst, or under data.on_error: skip the first sample after it
// (wrapping around) that can be read, and returns the index it read. Files found bad are
// recorded and not read again.
func (d *Dataset) readGood(i int, dst []uint8) (int, error) {
	for k := range d.N {
		j := (i + k) % d.N
		if d.skips != nil && d.skips.known(d, j) {
			continue
		}
		err := d.src.read(d.row(j), dst)
		if err == nil {
			return j, nil
		}
		err = fmt.Errorf("data: sample %d (%s): %w", j, d.src.name(d.row(j)), err)
		if d.fail || d.skips == nil {
			return 0, fmt.Errorf("%w (data.on_error: fail)", err)
		}
		d.skips.add(d, j, fmt.Errorf("%w: skipped (data.on_error: skip)", err))
	}
	return 0, fmt.Errorf("data: %w: all %d samples failed to decode", errAllBad, d.N)
}

// FillRange writes samples start..start+count-1 into b, as Fill does; evaluation walks the
// test set with it. For an in-memory dataset it allocates nothing.
func (d *Dataset) FillRange(b *Batch, start, count int, norm Normalize) error {
	ss, err := d.checkFill(b, count, norm)
	if err != nil {
		return err
	}
	if start < 0 || count < 0 || start > d.N-count {
		return fmt.Errorf("data: fill batch: samples [%d, %d) are outside [0, %d)", start, start+count, d.N)
	}
	if d.Images == nil || len(norm.PerChannel) > 0 || d.rows != nil {
		if count > rangeStack {
			idx := make([]int32, count)
			for k := range idx {
				idx[k] = int32(start + k)
			}
			return d.fillGeneral(b, idx, norm, nil, false)
		}
		var buf [rangeStack]int32
		idx := buf[:count]
		for k := range idx {
			idx[k] = int32(start + k)
		}
		return d.fillGeneral(b, idx, norm, nil, false)
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

// rangeStack is how many indices FillRange keeps on the stack when it must list them.
const rangeStack = 1024

// checkFill validates everything Fill and FillRange index with, so a hand-built Dataset or
// Batch with inconsistent fields yields an error instead of a panic. It returns the sample
// size.
func (d *Dataset) checkFill(b *Batch, rows int, norm Normalize) (int, error) {
	ss := d.SampleSize()
	switch {
	case ss < 1 || d.N < 0 || d.C < 1 || d.C > MaxChannels || len(d.Labels) != d.N ||
		(d.src == nil && d.floats == nil && len(d.Images) != d.storedN()*ss) || (d.floats != nil && len(d.floats) != d.storedN()*ss) ||
		(d.rows != nil && len(d.rows) != d.N):
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
