package engine

import (
	"fmt"
	"math"
	"sync"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
	"github.com/qvd/qvd/memory"
)

// Reference is the reference Device: plain Go on the CPU, one operation at a time, with the CUDA
// backend's semantics — half-precision buffers hold values rounded to their type, every
// operation computes in fp32 and rounds once when it stores. The engine's tests run on it
// everywhere, and the CUDA kernels are checked against it on a GPU.
type Reference struct {
	mu    sync.Mutex
	next  Ptr
	mem   map[Ptr]*hostAlloc
	limit uint64 // bytes Malloc may hold in all (0 = unlimited)
	used  uint64
	err   error
}

type hostAlloc struct {
	f []float32 // floating-point types (values rounded to the type)
	i []int32   // I32
	t DType
}

var _ Device = (*Reference)(nil)

// NewReference returns a reference device with no memory limit.
func NewReference() *Reference { return &Reference{next: 1 << 12, mem: map[Ptr]*hostAlloc{}} }

// NewReferenceLimit returns a reference device whose Malloc fails with memory.ErrOutOfMemory past
// limit bytes: a small GPU for tests of the out-of-memory paths.
func NewReferenceLimit(limit uint64) *Reference {
	h := NewReference()
	h.limit = limit
	return h
}

func (h *Reference) Name() string { return "host reference device (plain Go)" }

func (h *Reference) TotalMemory() uint64 { return h.limit }

func (h *Reference) Malloc(n int, t DType) (Buf, error) {
	if n < 0 || t.Size() == 0 {
		return Buf{}, fmt.Errorf("%w: malloc of %d elements of %v", ErrDevice, n, t)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	bytes := uint64(n * t.Size())
	if h.limit > 0 && h.used+bytes > h.limit {
		return Buf{}, fmt.Errorf("%w: %s on the host reference device (%d of %d bytes in use)", memory.ErrOutOfMemory, fmtBytes(bytes), h.used, h.limit)
	}
	a := &hostAlloc{t: t}
	if t == I32 {
		a.i = make([]int32, n)
	} else {
		a.f = make([]float32, n)
	}
	p := h.next
	h.next += Ptr((bytes + 511) &^ 255) // distinct, aligned, never 0
	h.mem[p] = a
	h.used += bytes
	return Buf{Ptr: p, N: n, T: t}, nil
}

func (h *Reference) Release(b Buf) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if a, ok := h.mem[b.Ptr]; ok {
		h.used -= uint64(max(len(a.f), len(a.i)) * a.t.Size())
		delete(h.mem, b.Ptr)
	}
}

// fail latches the first error, as a CUDA context keeps its first fault.
func (h *Reference) fail(format string, args ...any) {
	if h.err == nil {
		h.err = fmt.Errorf("%w: "+format, append([]any{ErrDevice}, args...)...)
	}
}

// f returns the float32 storage of b, or nil (with the error latched) for a bad view.
func (h *Reference) f(b Buf) []float32 {
	if h.err != nil {
		return nil
	}
	a, ok := h.mem[b.Ptr]
	switch {
	case !ok:
		h.fail("no allocation at %#x", b.Ptr)
		return nil
	case a.t != b.T || !b.T.Float():
		h.fail("view of type %v over a %v allocation", b.T, a.t)
		return nil
	case b.Off < 0 || b.Off+b.N > len(a.f):
		h.fail("view [%d, %d) outside an allocation of %d", b.Off, b.Off+b.N, len(a.f))
		return nil
	}
	return a.f[b.Off : b.Off+b.N]
}

func (h *Reference) i32(b Buf) []int32 {
	if h.err != nil {
		return nil
	}
	a, ok := h.mem[b.Ptr]
	switch {
	case !ok:
		h.fail("no allocation at %#x", b.Ptr)
		return nil
	case a.t != I32 || b.T != I32:
		h.fail("int32 view of a %v allocation", a.t)
		return nil
	case b.Off < 0 || b.Off+b.N > len(a.i):
		h.fail("view [%d, %d) outside an allocation of %d", b.Off, b.Off+b.N, len(a.i))
		return nil
	}
	return a.i[b.Off : b.Off+b.N]
}

// check latches an error unless every condition holds; it reports whether to go on.
func (h *Reference) check(ok bool, format string, args ...any) bool {
	if !ok {
		h.fail(format, args...)
	}
	return ok && h.err == nil
}

// round stores x rounded to t.
func round(x []float32, t DType) {
	if t != F32 {
		vec.Round(x, t.Format())
	}
}

func round1(v float32, t DType) float32 {
	switch t {
	case F16:
		return half.F16ToF32(half.F32ToF16(v))
	case BF16:
		return half.BF16ToF32(half.F32ToBF16(v))
	}
	return v
}

func (h *Reference) Upload(dst Buf, src []float32) {
	d := h.f(dst)
	if d == nil || !h.check(len(src) == dst.N, "upload of %d values into %d", len(src), dst.N) {
		return
	}
	copy(d, src)
	round(d, dst.T)
}

// UploadAsync is Upload: the reference device has one stream, so nothing overlaps.
func (h *Reference) UploadAsync(dst Buf, src []float32) { h.Upload(dst, src) }

// WaitUploads has nothing to wait for.
func (h *Reference) WaitUploads() {}

// DownloadAsync copies at once: the reference device has one stream.
func (h *Reference) DownloadAsync(dst []float32, src Buf) {
	if s := h.f(src); s != nil && h.check(len(dst) == src.N, "download of %d values into %d", src.N, len(dst)) {
		copy(dst, s)
	}
}

// WaitDownloads returns the first error since the last Sync, as Download does.
func (h *Reference) WaitDownloads() error { return h.Sync() }

func (h *Reference) UploadInt32(dst Buf, src []int32) {
	d := h.i32(dst)
	if d == nil || !h.check(len(src) == dst.N, "upload of %d ints into %d", len(src), dst.N) {
		return
	}
	copy(d, src)
}

func (h *Reference) Download(dst []float32, src Buf) error {
	if src.T == I32 {
		s := h.i32(src)
		if s != nil && h.check(len(dst) == src.N, "download of %d values into %d", src.N, len(dst)) {
			for i, v := range s {
				dst[i] = float32(v)
			}
		}
		return h.Sync()
	}
	s := h.f(src)
	if s != nil && h.check(len(dst) == src.N, "download of %d values into %d", src.N, len(dst)) {
		copy(dst, s)
	}
	return h.Sync()
}

func (h *Reference) Fill(b Buf, v float32) {
	if b.T == I32 {
		if d := h.i32(b); d != nil {
			for i := range d {
				d[i] = int32(v)
			}
		}
		return
	}
	d := h.f(b)
	v = round1(v, b.T)
	for i := range d {
		d[i] = v
	}
}

func (h *Reference) Copy(dst, src Buf) {
	d, s := h.f(dst), h.f(src)
	if d == nil || s == nil || !h.check(dst.N == src.N, "copy of %d elements into %d", src.N, dst.N) {
		return
	}
	copy(d, s)
	round(d, dst.T)
}

func (h *Reference) Gemm(transA, transB bool, m, n, k int, alpha float32, a, b Buf, beta float32, c Buf) {
	if !h.check(a.N == m*k && b.N == k*n && c.N == m*n, "gemm %dx%dx%d on buffers of %d, %d, %d", m, n, k, a.N, b.N, c.N) {
		return
	}
	lda, ldb := ContiguousLDs(transA, transB, m, n, k)
	h.GemmLD(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, max(n, 1))
}

func (h *Reference) GemmLD(transA, transB bool, m, n, k int, alpha float32, a Buf, lda int, b Buf, ldb int, beta float32, c Buf, ldc int) {
	A, B, C := h.f(a), h.f(b), h.f(c)
	if A == nil || B == nil || C == nil {
		return
	}
	if !h.check(GemmFits(transA, transB, m, n, k, len(A), lda, len(B), ldb, len(C), ldc),
		"gemm %dx%dx%d (ld %d, %d, %d) on buffers of %d, %d, %d", m, n, k, lda, ldb, ldc, len(A), len(B), len(C)) {
		return
	}
	at := func(i, p int) float32 {
		if transA {
			return A[p*lda+i]
		}
		return A[i*lda+p]
	}
	bt := func(p, j int) float32 {
		if transB {
			return B[j*ldb+p]
		}
		return B[p*ldb+j]
	}
	row := make([]float32, n)
	for i := 0; i < m; i++ {
		clear(row)
		for p := 0; p < k; p++ {
			av := at(i, p)
			if av == 0 {
				continue
			}
			for j := 0; j < n; j++ {
				row[j] += av * bt(p, j)
			}
		}
		for j := 0; j < n; j++ {
			v := alpha * row[j]
			if beta != 0 {
				v += beta * C[i*ldc+j]
			}
			C[i*ldc+j] = round1(v, c.T)
		}
	}
}

// ConvWorkspace: the reference device convolves directly, with no workspace.
func (h *Reference) ConvWorkspace(s ConvShape, t DType) (int, DType) { return 0, t }

// convCheck resolves and checks a convolution's buffers (those not Valid come back nil).
func (h *Reference) convCheck(op string, s ConvShape, x, y, w Buf) (X, Y, W []float32, ok bool) {
	if !h.check(s.Valid(), "%s: invalid shape %v", op, s) {
		return nil, nil, nil, false
	}
	nx, ny, nw := s.Elems()
	X, Y, W = h.f(x), h.f(y), h.f(w)
	return X, Y, W, X != nil && Y != nil && W != nil &&
		h.check(len(X) == nx && len(Y) == ny && len(W) == nw, "%s: buffers of %d, %d, %d for %v", op, len(X), len(Y), len(W), s)
}

// Conv2D is the convolution's definition, summed directly in fp32 (an oracle for the
// backends' unfolded and per-sample GEMMs, independent of both).
func (h *Reference) Conv2D(y, x, w, bias, ws Buf, s ConvShape) {
	X, Y, W, ok := h.convCheck("conv2d", s, x, y, w)
	B := h.f(bias)
	if !ok || B == nil || !h.check(len(B) == s.Out, "conv2d: %d biases for %d channels", len(B), s.Out) {
		return
	}
	oh, ow := s.OH(), s.OW()
	for n := 0; n < s.N; n++ {
		for o := 0; o < s.Out; o++ {
			for oy := 0; oy < oh; oy++ {
				for ox := 0; ox < ow; ox++ {
					var sum float32
					for c := 0; c < s.C; c++ {
						for ki := 0; ki < s.K; ki++ {
							iy := oy + ki - s.Pad
							if iy < 0 || iy >= s.H {
								continue
							}
							for kj := 0; kj < s.K; kj++ {
								ix := ox + kj - s.Pad
								if ix < 0 || ix >= s.W {
									continue
								}
								sum += X[((n*s.C+c)*s.H+iy)*s.W+ix] * W[((o*s.C+c)*s.K+ki)*s.K+kj]
							}
						}
					}
					Y[((n*s.Out+o)*oh+oy)*ow+ox] = round1(sum+B[o], y.T)
				}
			}
		}
	}
}

// Conv2DBackward sums the gradients directly from their definitions.
func (h *Reference) Conv2DBackward(dx, dw, db, dy, x, w, ws Buf, s ConvShape, beta float32) {
	X, DY, W, ok := h.convCheck("conv2d_backward", s, x, dy, w)
	if !ok {
		return
	}
	oh, ow := s.OH(), s.OW()
	// each visits every (sample, output pixel, input channel, kernel tap) that reads the input.
	each := func(f func(n, o, oy, ox, c, ki, kj, iy, ix int)) {
		for n := 0; n < s.N; n++ {
			for o := 0; o < s.Out; o++ {
				for oy := 0; oy < oh; oy++ {
					for ox := 0; ox < ow; ox++ {
						for c := 0; c < s.C; c++ {
							for ki := 0; ki < s.K; ki++ {
								for kj := 0; kj < s.K; kj++ {
									iy, ix := oy+ki-s.Pad, ox+kj-s.Pad
									if iy >= 0 && iy < s.H && ix >= 0 && ix < s.W {
										f(n, o, oy, ox, c, ki, kj, iy, ix)
									}
								}
							}
						}
					}
				}
			}
		}
	}
	g := func(n, o, oy, ox int) float32 { return DY[((n*s.Out+o)*oh+oy)*ow+ox] }
	if dw.Valid() {
		DW := h.f(dw)
		if DW == nil || !h.check(len(DW) == len(W), "conv2d_backward: dw has %d elements, w %d", len(DW), len(W)) {
			return
		}
		acc := make([]float32, len(W))
		each(func(n, o, oy, ox, c, ki, kj, iy, ix int) {
			acc[((o*s.C+c)*s.K+ki)*s.K+kj] += g(n, o, oy, ox) * X[((n*s.C+c)*s.H+iy)*s.W+ix]
		})
		for i, v := range acc {
			if beta != 0 {
				v += beta * DW[i]
			}
			DW[i] = round1(v, dw.T)
		}
	}
	if db.Valid() {
		DB := h.f(db)
		if DB == nil || !h.check(len(DB) == s.Out, "conv2d_backward: %d bias gradients for %d channels", len(DB), s.Out) {
			return
		}
		for o := 0; o < s.Out; o++ {
			var sum float32
			for n := 0; n < s.N; n++ {
				for p := 0; p < oh*ow; p++ {
					sum += DY[(n*s.Out+o)*oh*ow+p]
				}
			}
			if beta != 0 {
				sum += beta * DB[o]
			}
			DB[o] = round1(sum, db.T)
		}
	}
	if dx.Valid() {
		DX := h.f(dx)
		if DX == nil || !h.check(len(DX) == len(X), "conv2d_backward: dx has %d elements, x %d", len(DX), len(X)) {
			return
		}
		acc := make([]float32, len(X))
		each(func(n, o, oy, ox, c, ki, kj, iy, ix int) {
			acc[((n*s.C+c)*s.H+iy)*s.W+ix] += g(n, o, oy, ox) * W[((o*s.C+c)*s.K+ki)*s.K+kj]
		})
		for i, v := range acc {
			DX[i] = round1(v, dx.T)
		}
	}
}

// biasLen is the length of a per-column (or, perRow, per-row) vector of a rows×cols matrix.
func biasLen(rows, cols int, perRow bool) int {
	if perRow {
		return rows
	}
	return cols
}

func (h *Reference) AddBias(y, bias Buf, rows, cols int, perRow bool) {
	Y, B := h.f(y), h.f(bias)
	if Y == nil || B == nil {
		return
	}
	want := biasLen(rows, cols, perRow)
	if !h.check(len(Y) == rows*cols && len(B) == want, "add_bias %dx%d with %d biases", rows, cols, len(B)) {
		return
	}
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			var bv float32
			if perRow {
				bv = B[r]
			} else {
				bv = B[c]
			}
			Y[r*cols+c] = round1(Y[r*cols+c]+bv, y.T)
		}
	}
}

func (h *Reference) SumRows(dst, src Buf, rows, cols int, perRow bool, beta float32) {
	D, S := h.f(dst), h.f(src)
	if D == nil || S == nil {
		return
	}
	want := biasLen(rows, cols, perRow)
	if !h.check(len(S) == rows*cols && len(D) == want, "sum_rows %dx%d into %d", rows, cols, len(D)) {
		return
	}
	acc := make([]float32, want)
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			if perRow {
				acc[r] += S[r*cols+c]
			} else {
				acc[c] += S[r*cols+c]
			}
		}
	}
	for i, v := range acc {
		if beta != 0 {
			v += beta * D[i]
		}
		D[i] = round1(v, dst.T)
	}
}

func (h *Reference) ReLU(y, x Buf) {
	Y, X := h.f(y), h.f(x)
	if Y == nil || X == nil || !h.check(len(Y) == len(X), "relu of %d into %d", len(X), len(Y)) {
		return
	}
	for i, v := range X {
		Y[i] = round1(max(v, 0), y.T)
	}
}

func (h *Reference) ReLUGrad(dx, dy, y Buf) {
	DX, DY, Y := h.f(dx), h.f(dy), h.f(y)
	if DX == nil || DY == nil || Y == nil || !h.check(len(DX) == len(DY) && len(DY) == len(Y), "relu_grad lengths %d, %d, %d", len(DX), len(DY), len(Y)) {
		return
	}
	for i := range DX {
		if Y[i] > 0 {
			DX[i] = round1(DY[i], dx.T)
		} else {
			DX[i] = 0
		}
	}
}

func (h *Reference) Transpose01(dst, src Buf, a, b, r int) {
	D, S := h.f(dst), h.f(src)
	if D == nil || S == nil || !h.check(len(D) == a*b*r && len(S) == a*b*r, "transpose01 %dx%dx%d on %d and %d", a, b, r, len(S), len(D)) {
		return
	}
	for i := 0; i < a; i++ {
		for j := 0; j < b; j++ {
			for q := 0; q < r; q++ {
				D[(j*a+i)*r+q] = round1(S[(i*b+j)*r+q], dst.T)
			}
		}
	}
}

// convShapes checks an image buffer x (n×c×hh×w) against its unfolded columns cols
// ((c·k·k)×(n·oh·ow)) for a k×k, stride-1 convolution and returns the output size; false
// (with the error latched) if either buffer is missing or the shapes disagree.
func (h *Reference) convShapes(op string, cols, x []float32, n, c, hh, w, k, pad int) (oh, ow int, ok bool) {
	oh, ow = hh+2*pad-k+1, w+2*pad-k+1
	ok = cols != nil && x != nil &&
		h.check(len(x) == n*c*hh*w && len(cols) == c*k*k*n*oh*ow && oh > 0 && ow > 0, "%s shapes", op)
	return oh, ow, ok
}

func (h *Reference) Im2Col(cols, x Buf, n, c, hh, w, k, pad int) {
	C, X := h.f(cols), h.f(x)
	oh, ow, ok := h.convShapes("im2col", C, X, n, c, hh, w, k, pad)
	if !ok {
		return
	}
	npix := n * oh * ow
	for ch := 0; ch < c; ch++ {
		for ki := 0; ki < k; ki++ {
			for kj := 0; kj < k; kj++ {
				row := C[((ch*k+ki)*k+kj)*npix:]
				for s := 0; s < n; s++ {
					for oy := 0; oy < oh; oy++ {
						for ox := 0; ox < ow; ox++ {
							iy, ix := oy+ki-pad, ox+kj-pad
							v := float32(0)
							if iy >= 0 && iy < hh && ix >= 0 && ix < w {
								v = X[((s*c+ch)*hh+iy)*w+ix]
							}
							row[(s*oh+oy)*ow+ox] = round1(v, cols.T)
						}
					}
				}
			}
		}
	}
}

func (h *Reference) Col2Im(dx, cols Buf, n, c, hh, w, k, pad int) {
	D, C := h.f(dx), h.f(cols)
	oh, ow, ok := h.convShapes("col2im", C, D, n, c, hh, w, k, pad)
	if !ok {
		return
	}
	npix := n * oh * ow
	for s := 0; s < n; s++ {
		for ch := 0; ch < c; ch++ {
			for iy := 0; iy < hh; iy++ {
				for ix := 0; ix < w; ix++ {
					var sum float32
					for ki := 0; ki < k; ki++ {
						oy := iy - ki + pad
						if oy < 0 || oy >= oh {
							continue
						}
						for kj := 0; kj < k; kj++ {
							ox := ix - kj + pad
							if ox < 0 || ox >= ow {
								continue
							}
							sum += C[((ch*k+ki)*k+kj)*npix+(s*oh+oy)*ow+ox]
						}
					}
					D[((s*c+ch)*hh+iy)*w+ix] = round1(sum, dx.T)
				}
			}
		}
	}
}

func (h *Reference) MaxPool2(y, idx, x Buf, planes, hh, w int) {
	Y, I, X := h.f(y), h.i32(idx), h.f(x)
	oh, ow := hh/2, w/2
	if Y == nil || I == nil || X == nil || !h.check(len(X) == planes*hh*w && len(Y) == planes*oh*ow && len(I) == len(Y), "maxpool2 shapes") {
		return
	}
	for p := 0; p < planes; p++ {
		for oy := 0; oy < oh; oy++ {
			for ox := 0; ox < ow; ox++ {
				best := p*hh*w + 2*oy*w + 2*ox
				for _, d := range [3]int{1, w, w + 1} {
					// Strictly greater: the first maximum in row-major order wins, as in the kernel.
					if j := p*hh*w + 2*oy*w + 2*ox + d; X[j] > X[best] {
						best = j
					}
				}
				o := (p*oh+oy)*ow + ox
				Y[o] = round1(X[best], y.T)
				I[o] = int32(best)
			}
		}
	}
}

func (h *Reference) MaxPool2Grad(dx, dy, idx Buf) {
	DX, DY, I := h.f(dx), h.f(dy), h.i32(idx)
	if DX == nil || DY == nil || I == nil || !h.check(len(DY) == len(I), "maxpool2_grad: %d gradients, %d indices", len(DY), len(I)) {
		return
	}
	clear(DX)
	for i, j := range I {
		if !h.check(j >= 0 && int(j) < len(DX), "maxpool2_grad: index %d outside %d", j, len(DX)) {
			return
		}
		DX[j] = round1(DY[i], dx.T)
	}
}

func (h *Reference) SoftmaxXent(dlogits, loss, logits, labels Buf, rows, classes int, scale float32) {
	D, L, Z, Y := h.f(dlogits), h.f(loss), h.f(logits), h.i32(labels)
	if D == nil || L == nil || Z == nil || Y == nil {
		return
	}
	if !h.check(len(Z) == rows*classes && len(D) == len(Z) && len(L) == rows && len(Y) == rows && loss.T == F32, "softmax_xent shapes") {
		return
	}
	for r := 0; r < rows; r++ {
		z := Z[r*classes : (r+1)*classes]
		d := D[r*classes : (r+1)*classes]
		y := int(Y[r])
		if !h.check(y >= 0 && y < classes, "softmax_xent: label %d of row %d outside [0, %d)", y, r, classes) {
			return
		}
		m := z[0]
		for _, v := range z {
			m = max(m, v)
		}
		var sum float32
		for _, v := range z {
			sum += float32(math.Exp(float64(v - m)))
		}
		lse := m + float32(math.Log(float64(sum)))
		L[r] = lse - z[y]
		for c, v := range z {
			p := float32(math.Exp(float64(v - lse)))
			if c == y {
				p -= 1
			}
			d[c] = round1(p*scale, dlogits.T)
		}
	}
}

func (h *Reference) AdamW(p, m, v, g, w Buf, c vec.AdamConsts) {
	P, M, V, G := h.f(p), h.f(m), h.f(v), h.f(g)
	if P == nil || M == nil || V == nil || G == nil {
		return
	}
	if !h.check(p.T == F32 && m.T == F32 && v.T == F32 && len(M) == len(P) && len(V) == len(P) && len(G) == len(P), "adamw: shapes or types") {
		return
	}
	vec.AdamW(P, G, M, V, &c)
	if w.Valid() {
		W := h.f(w)
		if W == nil || !h.check(len(W) == len(P), "adamw: %d working weights for %d", len(W), len(P)) {
			return
		}
		copy(W, P)
		round(W, w.T)
	}
}

func (h *Reference) UnscaleCheck(g, found Buf, s float32) {
	G, F := h.f(g), h.f(found)
	if G == nil || F == nil || !h.check(len(F) == 1, "unscale_check: found has %d elements", len(F)) {
		return
	}
	for i, v := range G {
		if math.IsInf(float64(v), 0) || math.IsNaN(float64(v)) {
			F[0] = 1
		}
		G[i] = round1(v*s, g.T)
	}
}

func (h *Reference) SumSquares(acc, g Buf) {
	A, G := h.f(acc), h.f(g)
	if A == nil || G == nil || !h.check(len(A) == 1 && acc.T == F32, "sum_squares: accumulator must be one f32") {
		return
	}
	var s float32
	for _, v := range G {
		s += v * v
	}
	A[0] += s
}

func (h *Reference) Sync() error {
	err := h.err
	h.err = nil
	return err
}

func (h *Reference) Close() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.mem = map[Ptr]*hostAlloc{}
	h.used = 0
	return nil
}

func fmtBytes(b uint64) string { return fmt.Sprintf("%d bytes", b) }
