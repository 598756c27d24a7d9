package enginetest

import (
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/qvd/qvd/engine"
)

// NewDevice returns a fresh device; the suite closes it at the end of each test.
type NewDevice func() engine.Device

// FloatTypes are the element types every floating-point operation is checked in.
var FloatTypes = []engine.DType{engine.F32, engine.F16, engine.BF16}

const (
	// guard is the number of elements on each side of every buffer the suite allocates,
	// filled with guardValue and checked when the test ends: an operation that writes outside
	// its views is caught.
	guard      = 16
	guardValue = -77 // exact in every element type
	// u32 is fp32's unit roundoff, 2⁻²⁴.
	u32 = 1.0 / (1 << 24)
)

// TestDevice runs the whole suite on devices made by newDevice.
func TestDevice(t *testing.T, newDevice NewDevice) {
	for _, tc := range []struct {
		name string
		f    func(*testing.T, NewDevice)
	}{
		{"Memory", TestMemory},
		{"UploadDownload", TestUploadDownload},
		{"Fill", TestFill},
		{"Copy", TestCopy},
		{"GemmEmpty", TestGemmEmpty},
		{"Gemm", TestGemm},
		{"GemmLD", TestGemmLD},
		{"AddBias", TestAddBias},
		{"SumRows", TestSumRows},
		{"ReLU", TestReLU},
		{"ReLUGrad", TestReLUGrad},
		{"Transpose01", TestTranspose01},
		{"Im2ColCol2Im", TestIm2ColCol2Im},
		{"MaxPool2", TestMaxPool2},
		{"SoftmaxXent", TestSoftmaxXent},
		{"Conv2D", TestConv2D},
		{"Conv2DBackward", TestConv2DBackward},
		{"UnfoldConv2D", TestUnfoldConv2D},
		{"AdamW", TestAdamW},
		{"UnscaleCheck", TestUnscaleCheck},
		{"SumSquares", TestSumSquares},
		{"Errors", TestErrors},
		{"GemmBatched", TestGemmBatched},
		{"GemmBatchedEmpty", TestGemmBatchedEmpty},
		{"Axpby", TestAxpby},
		{"CopyRows", TestCopyRows},
		{"LayerNorm", TestLayerNorm},
		{"LayerNormBackward", TestLayerNormBackward},
		{"GELU", TestGELU},
		{"GELUGrad", TestGELUGrad},
		{"Dropout", TestDropout},
		{"Softmax", TestSoftmax},
		{"SoftmaxGrad", TestSoftmaxGrad},
		{"Patchify", TestPatchify},
		{"BatchNorm", TestBatchNorm},
		{"BatchNormBackward", TestBatchNormBackward},
		{"TransformerErrors", TestTransformerErrors},
	} {
		t.Run(tc.name, func(t *testing.T) { tc.f(t, newDevice) })
	}
}

// harness is one test's device, random source and buffers.
type harness struct {
	t      *testing.T
	d      engine.Device
	rng    *rand.Rand
	allocs []guarded
}

// guarded is a buffer the suite allocated: the view under test inside an allocation with
// guard zones.
type guarded struct {
	whole, view engine.Buf
}

// newHarness opens a device for t; the device's pending error, the guard zones and the
// device itself are checked and closed when t ends.
func newHarness(t *testing.T, newDevice NewDevice) *harness {
	t.Helper()
	d := newDevice()
	h := &harness{t: t, d: d, rng: rand.New(rand.NewPCG(seed(t.Name()), 0x9e3779b97f4a7c15))}
	t.Cleanup(func() {
		if err := d.Sync(); err != nil {
			t.Errorf("error pending at the end of the test: %v", err)
		}
		h.checkGuards()
		for _, a := range h.allocs {
			d.Release(a.whole)
		}
		if err := d.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return h
}

// seed derives a test's random seed from its name, so that each subtest draws its own
// numbers and a failing one reproduces when run alone.
func seed(name string) uint64 {
	f := fnv.New64a()
	f.Write([]byte(name))
	return f.Sum64()
}

// alloc returns a view of n elements of t between two guard zones.
func (h *harness) alloc(n int, t engine.DType) engine.Buf {
	h.t.Helper()
	whole, err := h.d.Malloc(n+2*guard, t)
	if err != nil {
		h.t.Fatalf("malloc of %d %v: %v", n+2*guard, t, err)
	}
	h.d.Fill(whole, guardValue)
	v := whole.Slice(guard, guard+n)
	h.allocs = append(h.allocs, guarded{whole: whole, view: v})
	return v
}

// checkGuards reports every guard zone an operation wrote into.
func (h *harness) checkGuards() {
	h.t.Helper()
	for _, a := range h.allocs {
		all := make([]float32, a.whole.N)
		if err := h.d.Download(all, a.whole); err != nil {
			h.t.Errorf("download of a %v allocation of %d: %v", a.whole.T, a.whole.N, err)
			continue
		}
		for i, v := range all {
			if (i < guard || i >= a.whole.N-guard) && v != guardValue {
				h.t.Errorf("a %v buffer of %d elements: element %d of its guard zones was written (%v)", a.view.T, a.view.N, i-guard, v)
				break
			}
		}
	}
}

// sync fails the test if the device holds an error.
func (h *harness) sync(what string) {
	h.t.Helper()
	if err := h.d.Sync(); err != nil {
		h.t.Fatalf("%s: %v", what, err)
	}
}

// get downloads b.
func (h *harness) get(b engine.Buf) []float32 {
	h.t.Helper()
	out := make([]float32, b.N)
	if err := h.d.Download(out, b); err != nil {
		h.t.Fatalf("download of %d %v: %v", b.N, b.T, err)
	}
	return out
}

// put uploads vals into b and returns the values b holds (vals rounded to b's type).
func (h *harness) put(b engine.Buf, vals []float32) []float32 {
	h.t.Helper()
	h.d.Upload(b, vals)
	return h.get(b)
}

// normal returns n draws of N(0, scale²).
func (h *harness) normal(n int, scale float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(h.rng.NormFloat64() * scale)
	}
	return x
}

// random allocates n elements of t holding N(0, scale²) draws and returns the buffer and
// its values.
func (h *harness) random(n int, t engine.DType, scale float64) (engine.Buf, []float32) {
	h.t.Helper()
	b := h.alloc(n, t)
	return b, h.put(b, h.normal(n, scale))
}

// filled allocates n elements of t set to v.
func (h *harness) filled(n int, t engine.DType, v float32) (engine.Buf, []float32) {
	h.t.Helper()
	b := h.alloc(n, t)
	h.d.Fill(b, v)
	return b, h.get(b)
}

// roundTo is v as t stores it.
func roundTo(t engine.DType, v float32) float32 { return t.Format().Round(v) }

// ulp is the spacing of t's values at |x| (its subnormal spacing below the normal range).
func ulp(t engine.DType, x float64) float64 {
	mant, minExp := 23, -126
	switch t {
	case engine.F16:
		mant, minExp = 10, -14
	case engine.BF16:
		mant = 7
	}
	e := minExp
	if x = math.Abs(x); x > 0 && !math.IsInf(x, 0) {
		_, e2 := math.Frexp(x) // x = f·2^e2, f in [0.5, 1)
		e = max(e2-1, minExp)
	}
	return math.Ldexp(1, e-mant)
}

// tol is how far an element of type t may be from its float64 value want when the device
// accumulates terms fp32 operations whose magnitudes sum to mag, then rounds to t once.
func tol(t engine.DType, want, mag float64, terms int) float64 {
	e := float64(terms+2) * u32 * mag
	if t != engine.F32 {
		e += ulp(t, want)
	}
	return e + 1e-300
}

// mismatches collects a check's failures and reports the first few.
type mismatches struct {
	h     *harness
	what  string
	n     int
	lines []string
}

func (h *harness) check(format string, args ...any) *mismatches {
	return &mismatches{h: h, what: fmt.Sprintf(format, args...)}
}

func (m *mismatches) add(format string, args ...any) {
	if m.n < 6 {
		m.lines = append(m.lines, fmt.Sprintf(format, args...))
	}
	m.n++
}

func (m *mismatches) done() {
	m.h.t.Helper()
	if m.n > 0 {
		m.h.t.Errorf("%s: %d mismatches:\n\t%s", m.what, m.n, strings.Join(m.lines, "\n\t"))
	}
}

// same reports whether a and b are equal or both NaN.
func same(a, b float32) bool { return a == b || (a != a && b != b) }

// exact checks got against want element by element (NaN matches NaN).
func (h *harness) exact(what string, got, want []float32) {
	h.t.Helper()
	m := h.check("%s", what)
	if len(got) != len(want) {
		m.add("%d elements, want %d", len(got), len(want))
	}
	for i := range min(len(got), len(want)) {
		if !same(got[i], want[i]) {
			m.add("[%d] = %v, want %v", i, got[i], want[i])
		}
	}
	m.done()
}

// near checks got (type t) against the float64 values want, element i accumulating terms
// fp32 operations whose magnitudes sum to mag[i] (nil: |want[i]|).
func (h *harness) near(what string, t engine.DType, got []float32, want, mag []float64, terms int) {
	h.t.Helper()
	h.nearRel(what, t, got, want, mag, terms, 0)
}

// nearRel is near with rel·mag[i] more slack: for computations that round intermediates.
func (h *harness) nearRel(what string, t engine.DType, got []float32, want, mag []float64, terms int, rel float64) {
	h.t.Helper()
	m := h.check("%s", what)
	if len(got) != len(want) {
		m.add("%d elements, want %d", len(got), len(want))
	}
	for i := range min(len(got), len(want)) {
		mg := math.Abs(want[i])
		if mag != nil {
			mg = mag[i]
		}
		e := tol(t, want[i], mg, terms) + rel*mg
		if d := math.Abs(float64(got[i]) - want[i]); !(d <= e) {
			m.add("[%d] = %v, want %v (off by %.3g, tolerance %.3g)", i, got[i], want[i], d, e)
		}
	}
	m.done()
}

// f64 converts x to float64.
func f64(x []float32) []float64 {
	y := make([]float64, len(x))
	for i, v := range x {
		y[i] = float64(v)
	}
	return y
}

// nans returns n NaNs: what a buffer holds that an operation must overwrite without reading.
func nans(n int) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(math.NaN())
	}
	return x
}

// optional returns b, or an invalid Buf when !use.
func optional(b engine.Buf, use bool) engine.Buf {
	if use {
		return b
	}
	return engine.Buf{}
}
