//go:build cuda

package cuda

// The CUDA device against the reference device (engine.Reference): every operation on the same
// random inputs, per element type, compared exactly where both compute the same float32
// operations in the same order and within a tolerance where the order of a sum differs.
// These tests run only on a GPU machine (scripts/gpu/run.sh).

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/optim"
)

var dev *Device

func TestMain(m *testing.M) {
	var err error
	dev, err = Open(0)
	if err != nil {
		fmt.Fprintln(os.Stderr, "cuda tests:", err)
		os.Exit(1)
	}
	code := m.Run()
	if err := dev.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "cuda tests: close:", err)
		code = 1
	}
	os.Exit(code)
}

var floatTypes = []engine.DType{engine.F32, engine.F16, engine.BF16}

// twin is one buffer on both devices.
type twin struct {
	h, d engine.Buf
	n    int
	t    engine.DType
}

// pair runs one test on the reference and the CUDA device.
type pair struct {
	t   *testing.T
	h   *engine.Reference
	d   *Device
	rng *rand.Rand
	all []twin
}

func newPair(t *testing.T) *pair {
	t.Helper()
	if err := dev.Sync(); err != nil {
		t.Fatalf("a previous test left an error: %v", err)
	}
	p := &pair{t: t, h: engine.NewReference(), d: dev, rng: rand.New(rand.NewPCG(1, uint64(len(t.Name()))))}
	t.Cleanup(func() {
		for _, b := range p.all {
			p.d.Release(b.d)
		}
		if err := p.d.Sync(); err != nil {
			t.Errorf("cuda device after the test: %v", err)
		}
	})
	return p
}

// buf allocates n elements of t on both devices and uploads vals (nil: zeros).
func (p *pair) buf(t engine.DType, n int, vals []float32) twin {
	p.t.Helper()
	hb, err := p.h.Malloc(n, t)
	if err != nil {
		p.t.Fatal(err)
	}
	db, err := p.d.Malloc(n, t)
	if err != nil {
		p.t.Fatal(err)
	}
	b := twin{hb, db, n, t}
	p.all = append(p.all, b)
	if vals == nil {
		vals = make([]float32, n)
	}
	if t == engine.I32 {
		iv := make([]int32, n)
		for i, v := range vals {
			iv[i] = int32(v)
		}
		p.h.UploadInt32(hb, iv)
		p.d.UploadInt32(db, iv)
	} else {
		p.h.Upload(hb, vals)
		p.d.Upload(db, vals)
	}
	return b
}

// rand is a buffer of uniform values in [-scale, scale).
func (p *pair) rand(t engine.DType, n int, scale float32) twin {
	return p.buf(t, n, p.vals(n, scale))
}

func (p *pair) vals(n int, scale float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = (2*p.rng.Float32() - 1) * scale
	}
	return v
}

// get downloads b from both devices, failing the test on an error.
func (p *pair) get(b twin) (href, got []float32) {
	p.t.Helper()
	href, got = make([]float32, b.n), make([]float32, b.n)
	if err := p.h.Download(href, b.h); err != nil {
		p.t.Fatalf("reference device: %v", err)
	}
	if err := p.d.Download(got, b.d); err != nil {
		p.t.Fatalf("cuda device: %v", err)
	}
	return href, got
}

// ulp is the spacing of type t's values at magnitude x.
func ulp(t engine.DType, x float64) float64 {
	mant, minExp := 23, -126
	switch t {
	case engine.F16:
		mant, minExp = 10, -14
	case engine.BF16:
		mant = 7
	}
	_, e := math.Frexp(math.Abs(x)) // |x| = f·2^e, f in [0.5, 1)
	return math.Ldexp(1, max(e-1, minExp)-mant)
}

// same checks b on both devices: within ulps units in the last place of b's type plus atol
// (both 0: the same values, NaN matching NaN).
func (p *pair) same(what string, b twin, ulps, atol float64) {
	p.t.Helper()
	href, got := p.get(b)
	bad := 0
	for i := range href {
		h, g := float64(href[i]), float64(got[i])
		if h == g || math.IsNaN(h) && math.IsNaN(g) {
			continue
		}
		if !math.IsInf(h, 0) && !math.IsNaN(h) && math.Abs(h-g) <= ulps*ulp(b.t, max(math.Abs(h), math.Abs(g)))+atol {
			continue
		}
		if bad++; bad <= 5 {
			p.t.Errorf("%s [%v]: element %d: cuda %g, reference %g (tolerance %g ulp + %g)", what, b.t, i, g, h, ulps, atol)
		}
	}
	if bad > 5 {
		p.t.Errorf("%s [%v]: %d of %d elements differ", what, b.t, bad, len(href))
	}
}

func (p *pair) exact(what string, b twin) { p.t.Helper(); p.same(what, b, 0, 0) }

func maxAbs(x []float32) float64 {
	m := 0.0
	for _, v := range x {
		m = max(m, math.Abs(float64(v)))
	}
	return m
}

// specials are values whose conversions are easy to get wrong.
var specials = []float32{0, float32(math.Copysign(0, -1)), 1, -1, 65504, 65520, 70000, -70000, 1e-8, 6e-8, 3e-5,
	float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()), math.MaxFloat32, math.SmallestNonzeroFloat32,
	1.00048828125, 1.0009765625, 3.3895314e38}

func TestNameAndMemory(t *testing.T) {
	if !strings.Contains(dev.Name(), "(sm_") || !strings.Contains(dev.Name(), "driver") {
		t.Errorf("Name = %q", dev.Name())
	}
	free, total, err := dev.MemInfo()
	if err != nil || total == 0 || free == 0 || free > total || total > dev.TotalMemory() {
		t.Errorf("MemInfo = %d, %d, %v; TotalMemory %d", free, total, err, dev.TotalMemory())
	}
	t.Logf("%s: %d of %d MiB free", dev.Name(), free>>20, total>>20)
}

func TestUploadDownload(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		// Larger than two staging chunks, so the pipelined path and its tail run.
		v := p.vals(3*stageChunk/ty.Size()+12345, 100)
		copy(v, specials)
		p.exact("Upload", p.buf(ty, len(v), v))
	}
	labels := []float32{0, 1, -7, 1 << 30, -(1 << 30)}
	p.exact("UploadInt32", p.buf(engine.I32, len(labels), labels))
}

func TestUploadAsync(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		v := p.vals(2*stageChunk/ty.Size()+7, 10)
		b := p.buf(ty, len(v), nil)
		p.h.Upload(b.h, v)
		p.d.UploadAsync(b.d, v)
		p.d.WaitUploads()
		p.exact("UploadAsync", b)
	}
}

func TestFill(t *testing.T) {
	p := newPair(t)
	for _, ty := range append(floatTypes, engine.I32) {
		for _, v := range []float32{0, -1.5, 0.1, 70000, 3} {
			b := p.buf(ty, 1000, nil)
			p.h.Fill(b.h, v)
			p.d.Fill(b.d, v)
			p.exact(fmt.Sprintf("Fill(%g)", v), b)
		}
	}
}

func TestCopy(t *testing.T) {
	p := newPair(t)
	for _, dt := range floatTypes {
		for _, st := range floatTypes {
			v := p.vals(5000, 1000)
			copy(v, specials)
			src := p.buf(st, len(v), v)
			dst := p.buf(dt, len(v), nil)
			p.h.Copy(dst.h, src.h)
			p.d.Copy(dst.d, src.d)
			p.exact(fmt.Sprintf("Copy from %v", st), dst)
		}
	}
}

func TestGemm(t *testing.T) {
	p := newPair(t)
	shapes := [][3]int{{1, 1, 1}, {37, 53, 71}, {128, 64, 256}, {5, 300, 3}, {64, 10, 0}}
	for _, ty := range floatTypes {
		cts := []engine.DType{ty}
		if ty != engine.F32 {
			cts = append(cts, engine.F32) // half inputs into an fp32 C
		}
		for _, ct := range cts {
			for _, s := range shapes {
				m, n, k := s[0], s[1], s[2]
				for tr := range 4 {
					transA, transB := tr&1 != 0, tr&2 != 0
					for _, beta := range []float32{0, 0.5} {
						a, b := p.rand(ty, m*k, 1), p.rand(ty, k*n, 1)
						c := p.rand(ct, m*n, 1)
						p.h.Gemm(transA, transB, m, n, k, 0.75, a.h, b.h, beta, c.h)
						p.d.Gemm(transA, transB, m, n, k, 0.75, a.d, b.d, beta, c.d)
						// Sums of k products of |x| <= 1 in another order: fp32 rounding of
						// the partial sums, ~1e-5 relative to the sum of magnitudes.
						atol := 1e-6 * float64(k+1)
						p.same(fmt.Sprintf("Gemm %v %dx%dx%d transA=%v transB=%v beta=%g", ct, m, n, k, transA, transB, beta), c, 1, atol)
					}
				}
			}
		}
	}
}

func TestAddBias(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, perRow := range []bool{false, true} {
			rows, cols := 33, 130
			nb := cols
			if perRow {
				nb = rows
			}
			y, bias := p.rand(ty, rows*cols, 3), p.rand(ty, nb, 3)
			p.h.AddBias(y.h, bias.h, rows, cols, perRow)
			p.d.AddBias(y.d, bias.d, rows, cols, perRow)
			p.exact(fmt.Sprintf("AddBias perRow=%v", perRow), y)
		}
	}
}

func TestSumRows(t *testing.T) {
	p := newPair(t)
	for _, dt := range floatTypes {
		for _, st := range floatTypes {
			for _, perRow := range []bool{false, true} {
				for _, shape := range [][2]int{{1000, 7}, {3, 5000}, {64, 64}, {0, 5}} {
					for _, beta := range []float32{0, 1, 0.5} {
						rows, cols := shape[0], shape[1]
						nd := cols
						if perRow {
							nd = rows
						}
						if nd == 0 {
							continue
						}
						src, dst := p.rand(st, rows*cols, 1), p.rand(dt, nd, 1)
						p.h.SumRows(dst.h, src.h, rows, cols, perRow, beta)
						p.d.SumRows(dst.d, src.d, rows, cols, perRow, beta)
						terms := max(rows, cols)
						p.same(fmt.Sprintf("SumRows %v→%v %dx%d perRow=%v beta=%g", st, dt, rows, cols, perRow, beta), dst, 1, 2e-7*float64(terms))
					}
				}
			}
		}
	}
}

func TestReLU(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		v := p.vals(10000, 2)
		copy(v, specials)
		x, y := p.buf(ty, len(v), v), p.buf(ty, len(v), nil)
		p.h.ReLU(y.h, x.h)
		p.d.ReLU(y.d, x.d)
		p.exact("ReLU", y)
		p.h.ReLU(x.h, x.h) // in place
		p.d.ReLU(x.d, x.d)
		p.exact("ReLU in place", x)

		dy, yy := p.rand(ty, len(v), 1), p.rand(ty, len(v), 1)
		dx := p.buf(ty, len(v), nil)
		p.h.ReLUGrad(dx.h, dy.h, yy.h)
		p.d.ReLUGrad(dx.d, dy.d, yy.d)
		p.exact("ReLUGrad", dx)
		p.h.ReLUGrad(dy.h, dy.h, yy.h)
		p.d.ReLUGrad(dy.d, dy.d, yy.d)
		p.exact("ReLUGrad in place", dy)
	}
}

func TestTranspose01(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range [][3]int{{3, 5, 7}, {64, 32, 1}, {1, 9, 4}, {17, 1, 33}} {
			a, b, r := s[0], s[1], s[2]
			src, dst := p.rand(ty, a*b*r, 5), p.buf(ty, a*b*r, nil)
			p.h.Transpose01(dst.h, src.h, a, b, r)
			p.d.Transpose01(dst.d, src.d, a, b, r)
			p.exact(fmt.Sprintf("Transpose01 %v", s), dst)
		}
	}
}

func TestIm2ColCol2Im(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range [][6]int{{2, 3, 8, 8, 3, 1}, {1, 1, 5, 7, 3, 0}, {3, 4, 6, 5, 5, 2}, {2, 2, 4, 4, 1, 0}} {
			n, c, h, w, k, pad := s[0], s[1], s[2], s[3], s[4], s[5]
			oh, ow := h+2*pad-k+1, w+2*pad-k+1
			x := p.rand(ty, n*c*h*w, 1)
			cols := p.buf(ty, c*k*k*n*oh*ow, nil)
			p.h.Im2Col(cols.h, x.h, n, c, h, w, k, pad)
			p.d.Im2Col(cols.d, x.d, n, c, h, w, k, pad)
			p.exact(fmt.Sprintf("Im2Col %v", s), cols)

			g := p.rand(ty, cols.n, 1)
			dx := p.rand(ty, x.n, 1) // overwritten
			p.h.Col2Im(dx.h, g.h, n, c, h, w, k, pad)
			p.d.Col2Im(dx.d, g.d, n, c, h, w, k, pad)
			p.same(fmt.Sprintf("Col2Im %v", s), dx, 1, 1e-6*float64(k*k))
		}
	}
}

func TestMaxPool2(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range [][3]int{{6, 8, 8}, {3, 5, 7}, {1, 2, 2}, {4, 1, 6}} {
			planes, h, w := s[0], s[1], s[2]
			ny := planes * (h / 2) * (w / 2)
			x := p.rand(ty, planes*h*w, 4)
			y, idx := p.buf(ty, ny, nil), p.buf(engine.I32, ny, nil)
			p.h.MaxPool2(y.h, idx.h, x.h, planes, h, w)
			p.d.MaxPool2(y.d, idx.d, x.d, planes, h, w)
			p.exact(fmt.Sprintf("MaxPool2 %v", s), y)
			p.exact(fmt.Sprintf("MaxPool2 %v idx", s), idx)

			dy := p.rand(ty, ny, 1)
			dx := p.rand(ty, x.n, 1) // zeroed by MaxPool2Grad
			p.h.MaxPool2Grad(dx.h, dy.h, idx.h)
			p.d.MaxPool2Grad(dx.d, dy.d, idx.d)
			p.exact(fmt.Sprintf("MaxPool2Grad %v", s), dx)
		}
	}
}

func TestSoftmaxXent(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, s := range [][2]int{{64, 10}, {7, 1000}, {3, 1}, {129, 33}} {
			rows, classes := s[0], s[1]
			labels := make([]float32, rows)
			for i := range labels {
				labels[i] = float32(p.rng.IntN(classes))
			}
			lab := p.buf(engine.I32, rows, labels)
			for _, alias := range []bool{false, true} {
				logits := p.rand(ty, rows*classes, 8)
				dl := logits
				if !alias {
					dl = p.buf(ty, rows*classes, nil)
				}
				loss := p.buf(engine.F32, rows, nil)
				p.h.SoftmaxXent(dl.h, loss.h, logits.h, lab.h, rows, classes, 0.25)
				p.d.SoftmaxXent(dl.d, loss.d, logits.d, lab.d, rows, classes, 0.25)
				what := fmt.Sprintf("SoftmaxXent %dx%d alias=%v", rows, classes, alias)
				p.same(what+" loss", loss, 64, 1e-5)
				p.same(what+" dlogits", dl, 1, 1e-6)
			}
		}
	}
}

func TestAdamW(t *testing.T) {
	p := newPair(t)
	cfg := optim.DefaultConfig()
	const n = 100003
	for _, gt := range floatTypes {
		for _, wt := range append([]engine.DType{0}, floatTypes...) {
			pw, m, v := p.rand(engine.F32, n, 1), p.buf(engine.F32, n, nil), p.buf(engine.F32, n, nil)
			var w twin
			if wt != 0 {
				w = p.buf(wt, n, nil)
			}
			for step := int64(1); step <= 3; step++ {
				g := p.rand(gt, n, 1000)
				c := optim.AdamWConsts(cfg, step, 1e-3, 1.0/1024)
				p.h.AdamW(pw.h, m.h, v.h, g.h, w.h, c)
				p.d.AdamW(pw.d, m.d, v.d, g.d, w.d, c)
			}
			what := fmt.Sprintf("AdamW g %v, w %v", gt, wt)
			p.exact(what+" p", pw)
			p.exact(what+" m", m)
			p.exact(what+" v", v)
			if wt != 0 {
				p.exact(what+" w", w)
			}
		}
	}
}

func TestUnscaleCheck(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, bad := range []float32{0, float32(math.Inf(-1)), float32(math.NaN())} {
			v := p.vals(50000, 60000)
			if bad != 0 {
				v[31337] = bad
			}
			g, found := p.buf(ty, len(v), v), p.buf(engine.F32, 1, nil)
			p.h.UnscaleCheck(g.h, found.h, 1.0/65536)
			p.d.UnscaleCheck(g.d, found.d, 1.0/65536)
			p.exact(fmt.Sprintf("UnscaleCheck(%g) g", bad), g)
			p.exact(fmt.Sprintf("UnscaleCheck(%g) found", bad), found)
		}
		// found is never cleared.
		g, found := p.rand(ty, 100, 1), p.buf(engine.F32, 1, []float32{1})
		p.h.UnscaleCheck(g.h, found.h, 2)
		p.d.UnscaleCheck(g.d, found.d, 2)
		p.exact("UnscaleCheck keeps found", found)
	}
}

func TestSumSquares(t *testing.T) {
	p := newPair(t)
	for _, ty := range floatTypes {
		for _, n := range []int{1, 1000, 1 << 20} {
			g := p.rand(ty, n, 2)
			acc := p.buf(engine.F32, 1, []float32{3})
			p.h.SumSquares(acc.h, g.h)
			p.d.SumSquares(acc.d, g.d)
			// Against the exact sum: the reference's sequential fp32 sum is itself off by
			// up to ~√n·2⁻²⁴ relative.
			gv, _ := p.get(g)
			exact := 3.0
			for _, x := range gv {
				exact += float64(x) * float64(x)
			}
			_, got := p.get(acc)
			if rel := math.Abs(float64(got[0])-exact) / exact; rel > 2e-5 {
				t.Errorf("SumSquares [%v] of %d: cuda %g, exact %g (relative error %.2g)", ty, n, got[0], exact, rel)
			}
		}
	}
}

func TestMallocOutOfMemory(t *testing.T) {
	n := int(dev.TotalMemory()/4) + 1
	b, err := dev.Malloc(n, engine.F32)
	if err == nil {
		dev.Release(b)
		t.Fatalf("Malloc of %d bytes on a %d-byte device succeeded", 4*n, dev.TotalMemory())
	}
	if !errors.Is(err, memory.ErrOutOfMemory) {
		t.Fatalf("Malloc beyond the device: %v, which does not wrap memory.ErrOutOfMemory", err)
	}
	// Malloc's failure is returned, not latched.
	if err := dev.Sync(); err != nil {
		t.Fatalf("Sync after a failed Malloc: %v", err)
	}
	b, err = dev.Malloc(1<<20, engine.BF16)
	if err != nil {
		t.Fatalf("Malloc after an out-of-memory failure: %v", err)
	}
	dev.Release(b)
}

func TestStickyError(t *testing.T) {
	p := newPair(t)
	x := p.buf(engine.F32, 4, []float32{1, 2, 3, 4})
	y := p.buf(engine.F32, 5, nil)
	p.d.ReLU(y.d, x.d) // mismatched lengths: latched
	p.d.Fill(x.d, 9)   // skipped
	err := p.d.Sync()
	if !errors.Is(err, engine.ErrDevice) || !strings.Contains(err.Error(), "ReLU") {
		t.Fatalf("Sync after a bad ReLU: %v", err)
	}
	if err := p.d.Sync(); err != nil {
		t.Fatalf("second Sync: %v, want the error cleared", err)
	}
	got := make([]float32, 4)
	if err := p.d.Download(got, x.d); err != nil || got[0] != 1 || got[3] != 4 {
		t.Fatalf("after the error: %v %v; the Fill after it must have been skipped", got, err)
	}

	// Download reports a latched error (and clears it, as Sync does) without copying.
	p.d.Gemm(false, false, 2, 2, 2, 1, x.d, x.d, 0, y.d)
	got[0] = -1
	if err := p.d.Download(got, x.d); !errors.Is(err, engine.ErrDevice) || !strings.Contains(err.Error(), "Gemm") || got[0] != -1 {
		t.Fatalf("Download after a bad Gemm: %v, dst %v", err, got)
	}
	if err := p.d.Sync(); err != nil {
		t.Fatalf("Sync after Download reported the error: %v", err)
	}
}
