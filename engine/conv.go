package engine

import "fmt"

// ConvShape is a stride-1 2-D convolution over N samples: C×H×W in, Out×OH×OW out, K×K
// kernel, Pad zeros on every side.
type ConvShape struct {
	N, C, H, W, Out, K, Pad int
}

// OH and OW are the output's height and width.
func (s ConvShape) OH() int { return s.H + 2*s.Pad - s.K + 1 }
func (s ConvShape) OW() int { return s.W + 2*s.Pad - s.K + 1 }

// Valid reports whether the shape describes a convolution with a non-empty output.
func (s ConvShape) Valid() bool {
	return s.N >= 0 && s.C > 0 && s.H > 0 && s.W > 0 && s.Out > 0 && s.K > 0 && s.Pad >= 0 && s.OH() > 0 && s.OW() > 0
}

// Elems are the element counts of x, y, w for the shape.
func (s ConvShape) Elems() (x, y, w int) {
	return s.N * s.C * s.H * s.W, s.N * s.Out * s.OH() * s.OW(), s.Out * s.C * s.K * s.K
}

func (s ConvShape) String() string {
	return fmt.Sprintf("conv %dx%dx%dx%d -> %d, k%d pad%d", s.N, s.C, s.H, s.W, s.Out, s.K, s.Pad)
}

// UnfoldWorkspace is the workspace of UnfoldConv2D and UnfoldConv2DBackward, in elements of
// the activations' type: the unfolded input (C·K·K × N·OH·OW), and for the backward pass its
// gradient and the output gradient in channel-major order as well.
func UnfoldWorkspace(s ConvShape) int {
	pix := s.N * s.OH() * s.OW()
	ckk := s.C * s.K * s.K
	return 2*ckk*pix + s.Out*pix
}

// UnfoldConv2D is Conv2D as a device with no convolution kernel of its own computes it, from
// its primitives: the batch unfolded into columns (Im2Col), one GEMM into channel-major
// order, the bias, and a transpose to NCHW. ws holds UnfoldWorkspace(s) elements of x's type.
func UnfoldConv2D(d Device, y, x, w, bias, ws Buf, s ConvShape) {
	pix := s.N * s.OH() * s.OW()
	ckk := s.C * s.K * s.K
	cols := ws.Slice(0, ckk*pix)
	ycm := ws.Slice(ckk*pix, ckk*pix+s.Out*pix)
	d.Im2Col(cols, x, s.N, s.C, s.H, s.W, s.K, s.Pad)
	d.Gemm(false, false, s.Out, pix, ckk, 1, w, cols, 0, ycm)
	d.AddBias(ycm, bias, s.Out, pix, true)
	d.Transpose01(y, ycm, s.Out, s.N, s.OH()*s.OW())
}

// UnfoldConv2DBackward is Conv2DBackward from the primitives (see UnfoldConv2D): the output
// gradient transposed to channel-major order, the weight gradient as one GEMM against the
// unfolded input (recomputed from x), the bias gradient as row sums, and the input gradient
// as a GEMM folded back (Col2Im).
func UnfoldConv2DBackward(d Device, dx, dw, db, dy, x, w, ws Buf, s ConvShape, beta float32) {
	ohw := s.OH() * s.OW()
	pix := s.N * ohw
	ckk := s.C * s.K * s.K
	cols := ws.Slice(0, ckk*pix)
	dcols := ws.Slice(ckk*pix, 2*ckk*pix)
	dycm := ws.Slice(2*ckk*pix, 2*ckk*pix+s.Out*pix)
	d.Transpose01(dycm, dy, s.N, s.Out, ohw)
	if dw.Valid() {
		d.Im2Col(cols, x, s.N, s.C, s.H, s.W, s.K, s.Pad)
		d.Gemm(false, true, s.Out, ckk, pix, 1, dycm, cols, beta, dw)
	}
	if db.Valid() {
		d.SumRows(db, dycm, s.Out, pix, true, beta)
	}
	if dx.Valid() {
		d.Gemm(true, false, ckk, pix, s.Out, 1, w, dycm, 0, dcols)
		d.Col2Im(dx, dcols, s.N, s.C, s.H, s.W, s.K, s.Pad)
	}
}
