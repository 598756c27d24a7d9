package model

import "fmt"

// GradSink receives a micro-batch's gradient while the backward pass produces it: the ZeRO
// engine (zero.Engine), which reduces each bucket of the flat space as soon as the backward
// pass has written all of it, while the pass goes on below (DDP's and DeepSpeed's overlap).
// Offsets are in the trainable part of the layout, [0, Layout.Trainable()).
//
// An engine calls Acquire for a piece of a tensor's gradient, writes the piece, and calls
// Release; pieces come in decreasing offset order (the backward pass runs from the last
// layer), and a piece never spans one of Cuts. Between Acquire and Release the memory is the
// engine's; after Release it is the sink's again.
type GradSink interface {
	// Cuts are the offsets where the sink's buckets begin, ascending: a piece never spans
	// one. The sink chose them among the tensors' starts and row starts (Layout.Extents), so a
	// tensor's gradient can be produced in whole rows between two cuts.
	Cuts() []int
	// Acquire returns the memory for gradient elements [lo, hi) (float32; the values are
	// rounded to the working precision by the writer) and whether the piece must be added to
	// what the memory holds (accumulation across micro-batches) or overwrite it. It may wait
	// for a bucket buffer to come free; it fails once a reduction has failed.
	Acquire(lo, hi int) (dst []float32, accumulate bool, err error)
	// Release says [lo, hi) is written.
	Release(lo, hi int) error
}

// ParamWaiter is a GradSink whose parameters may still be arriving when a pass starts: the
// ZeRO engine leaves the all-gather of the last step's update running under the next forward
// pass (zero.Engine.Prefetching). A model that reads the parameters in place calls
// WaitParams(hi) before a layer reads any trainable parameter below offset hi (in the
// trainable part); a model that copies them first waits for all of them instead.
type ParamWaiter interface {
	WaitParams(hi int) error
}

// LazyParams is a model that can read its parameters in place as they arrive: its
// ForwardBackward calls a ParamWaiter sink's WaitParams layer by layer. Where it says false
// the trainer waits for all of them (and copies them) before the pass.
type LazyParams interface {
	ReadsParamsInPlace() bool
}

// Extent is a trainable tensor's place in the trainable flat space and how its gradient can
// be produced in parts: whole rows of Row elements (Size when the tensor comes in one piece).
type Extent struct {
	Off, Size, Row int
}

// Extents lists the trainable tensors in increasing offset, relative to the frozen prefix.
// A Linear weight, stored [in, out], can be produced a block of input rows at a time (a
// product with the rows' slice of the layer input), so its Row is out; every other tensor is
// produced whole.
func (l *Layout) Extents() []Extent {
	var out []Extent
	for _, t := range l.Tensors {
		if t.Frozen {
			continue
		}
		e := Extent{Off: t.Offset - l.Frozen, Size: t.Size, Row: t.Size}
		if t.Transposed && len(t.Shape) == 2 {
			e.Row = t.Shape[0]
		}
		out = append(out, e)
	}
	return out
}

// Pieces splits extent e at the cuts inside it into pieces [lo, hi), highest first (the
// order in which a backward pass hands them over). A cut that falls inside a row is a bug in
// the sink and returns an error.
func (e Extent) Pieces(cuts []int, f func(lo, hi int) error) error {
	hi := e.Off + e.Size
	// The cuts inside (Off, Off+Size), from the top.
	for i := len(cuts) - 1; i >= 0 && hi > e.Off; i-- {
		c := cuts[i]
		if c >= hi {
			continue
		}
		if c <= e.Off {
			break
		}
		if (c-e.Off)%e.Row != 0 {
			return fmt.Errorf("model: bucket cut at %d splits a row of the tensor at [%d, %d) (rows of %d)", c, e.Off, e.Off+e.Size, e.Row)
		}
		if err := f(c, hi); err != nil {
			return err
		}
		hi = c
	}
	return f(e.Off, hi)
}

// FlatSink is a GradSink over one full gradient buffer that every piece is added into: the
// single-buffer accumulation of tests and tools.
type FlatSink []float32

func (s FlatSink) Cuts() []int { return nil }

func (s FlatSink) Acquire(lo, hi int) ([]float32, bool, error) {
	if lo < 0 || hi > len(s) || lo > hi {
		return nil, false, fmt.Errorf("model: gradient piece [%d, %d) outside a buffer of %d", lo, hi, len(s))
	}
	return s[lo:hi], true, nil
}

func (s FlatSink) Release(lo, hi int) error { return nil }
