//go:build cuda

package cuda

import (
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
)

// TestNetMatchesReference is the GPU engine on CUDA against the same engine on the reference
// device (which the default build's tests hold to the gorgonia engine): the same spec, weights
// and batches give the same loss, accumulated gradient (through the overlapped copies) and
// evaluation, for the shipped model shapes and every precision. The fp32 batches hold no
// decision near its boundary (see margins), so that summation order cannot flip a unit.
func TestNetMatchesReference(t *testing.T) {
	for _, tc := range netCases {
		t.Run(tc.name, func(t *testing.T) {
			r := compareNets(t, tc, dev)
			t.Logf("gradient relative error %.3g; device peak %d B; %d samples redrawn", r.grad, r.peak, r.redrawn)
			if r.loss > tc.tol {
				t.Errorf("loss or evaluation differ: relative error %.3g > %.3g", r.loss, tc.tol)
			}
			if r.grad > tc.tol {
				t.Fatalf("gradients differ: relative error %.3g > %.3g", r.grad, tc.tol)
			}
		})
	}
}

// TestNetMatchesReferenceCatches plants, on the CUDA side, the smallest error a wrong ReLU
// mask makes — one unit of one sample masked that should not be (dropUnit) — and checks that
// TestNetMatchesReference's comparison fails on it: drawing batches away from the boundaries
// did not make the comparison blind to a flipped unit that rounding cannot explain.
func TestNetMatchesReferenceCatches(t *testing.T) {
	for _, tc := range netCases {
		if tc.f != half.FP32 {
			continue
		}
		t.Run(tc.name, func(t *testing.T) {
			drop := &dropUnit{Device: dev}
			r := compareNets(t, tc, drop)
			if !drop.done || drop.err != nil {
				t.Fatalf("the planted error was not made (ReLUGrad called: %v; download: %v)", drop.done, drop.err)
			}
			t.Logf("with one unit's gradient dropped: gradient relative error %.3g (tolerance %.3g)", r.grad, tc.tol)
			if r.grad <= tc.tol {
				t.Fatalf("the comparison passed a dropped unit: relative error %.3g <= %.3g", r.grad, tc.tol)
			}
		})
	}
}

type netCase struct {
	name string
	cfg  model.Config
	f    half.Format
	tol  float64
}

var netCases = func() []netCase {
	mlp := model.Config{Type: model.TypeMLP, Hidden: []int{256, 128}}
	cnn := model.Config{Type: model.TypeCNN, Channels: []int{16, 32}, Kernel: 3, Hidden: []int{128}}
	return []netCase{
		{"mlp/fp32", mlp, half.FP32, 1e-4}, {"mlp/fp16", mlp, half.FP16, 2e-2}, {"mlp/bf16", mlp, half.BF16, 5e-2},
		{"cnn/fp32", cnn, half.FP32, 1e-4}, {"cnn/bf16", cnn, half.BF16, 5e-2},
	}
}()

// netDiff is how far the CUDA net is from the reference: the largest relative difference of
// the losses and the evaluation, the gradient's max|Δ| / max|g|, the device's peak memory and
// how many samples were redrawn to keep decisions off their boundaries.
type netDiff struct {
	loss, grad float64
	peak       int64
	redrawn    int
}

// netBatches keeps the batches compareNets drew for each case (the tests run one at a time):
// TestNetMatchesReferenceCatches reuses TestNetMatchesReference's instead of drawing again.
var netBatches = map[string][]*data.Batch{}

// compareNets runs two micro-batches and an evaluation on the reference and on d (dev, or dev
// with a planted error).
func compareNets(t *testing.T, tc netCase, d engine.Device) netDiff {
	const micro = 64
	spec, err := model.NewSpec(tc.cfg, []int{1, 28, 28}, 10)
	if err != nil {
		t.Fatal(err)
	}
	layout := model.NewLayout(spec)
	w := make([]float32, layout.Size)
	model.Init(spec, layout, w, 3)
	opt := engine.Options{MicroBatch: micro, EvalBatch: micro, Precision: tc.f}
	probe := &margins{Reference: engine.NewReference(), rows: micro}
	ref, err := engine.NewNet(engine.NewAllocator(probe), spec, layout, append([]float32(nil), w...), opt)
	if err != nil {
		t.Fatal(err)
	}
	defer ref.Close()
	alloc := engine.NewAllocator(d)
	defer alloc.Close()
	net, err := engine.NewNet(alloc, spec, layout, append([]float32(nil), w...), opt)
	if err != nil {
		t.Fatal(err)
	}
	defer net.Close()
	var r netDiff
	rel := func(a, b float64) float64 { return math.Abs(a-b) / math.Max(1, math.Abs(a)) }
	batches, ok := netBatches[tc.name]
	if !ok {
		rng := rand.New(rand.NewPCG(1, 2))
		for range 2 {
			b := data.NewBatch(micro, 784)
			b.N = micro
			for i := range b.X {
				b.X[i] = float32(rng.NormFloat64())
			}
			for i := 0; i < micro; i++ {
				b.Y[i] = int32(rng.IntN(10))
			}
			if tc.f == half.FP32 {
				r.redrawn += probe.clear(t, ref, b, rng)
			}
			batches = append(batches, b)
		}
		netBatches[tc.name] = batches
	}
	gr, gd := make([]float32, layout.Trainable()), make([]float32, layout.Trainable())
	for k, b := range batches {
		lr, err := ref.ForwardBackward(b, 128, model.FlatSink(gr))
		if err != nil {
			t.Fatal(err)
		}
		ld, err := net.ForwardBackward(b, 128, model.FlatSink(gd))
		if err != nil {
			t.Fatal(err)
		}
		if e := rel(float64(lr), float64(ld)); e > r.loss {
			t.Logf("micro-batch %d: loss reference %v, CUDA %v", k, lr, ld)
			r.loss = e
		}
		if k == 1 {
			re, rd := evalBoth(t, ref, net, b)
			if e := rel(re, rd); e > r.loss {
				t.Logf("evaluation loss sum: reference %v, CUDA %v", re, rd)
				r.loss = e
			}
		}
	}
	var dm, m float64
	for i := range gr {
		dm = math.Max(dm, math.Abs(float64(gr[i])-float64(gd[i])))
		m = math.Max(m, math.Abs(float64(gr[i])))
	}
	r.grad, r.peak = dm/m, alloc.Stats().MaxAllocated
	return r
}

// marginRel is how close to its boundary, relative to the RMS of the layer's inputs over the
// batch, a decision of the forward pass may lie before its sample is redrawn. Two fp32
// engines that sum in different orders (the reference sequentially; cuBLAS, or OpenBLAS under
// the emulator, in blocks) compute each pre-activation to within a few ulps of the partial
// sums: measured on these shapes, at most 5.5e-6 of the layer's RMS (the 1568-input dense layer
// of the CNN, after two convolutions' worth of error). 5e-5 leaves a factor of 9.
const marginRel = 5e-5

// margins is the reference device, recording during a forward pass which samples hold a
// decision within marginRel of its boundary: a ReLU input near 0, or a 2×2 max-pool window
// whose two largest inputs are that close (the gradient goes to one or the other). One such
// decision taken the other way moves a whole unit's gradient in that sample, far more than
// rounding, so an fp32 comparison is only exact on batches without any; half-precision
// tolerances are loose enough to absorb the units their rounding flips.
type margins struct {
	*engine.Reference
	rows int
	near map[int]bool // nil: not recording
}

func (p *margins) ReLU(y, x engine.Buf) {
	if v := p.values(x); v != nil {
		d := marginRel * rms(v)
		for i, z := range v {
			if math.Abs(float64(z)) < d {
				p.near[i/(len(v)/p.rows)] = true
			}
		}
	}
	p.Reference.ReLU(y, x)
}

func (p *margins) MaxPool2(y, idx, x engine.Buf, planes, h, w int) {
	if v := p.values(x); v != nil {
		d := marginRel * rms(v)
		for pl := 0; pl < planes; pl++ {
			for o := 0; o < h/2*(w/2); o++ {
				base := pl*h*w + 2*(o/(w/2))*w + 2*(o%(w/2))
				win := [4]float64{float64(v[base]), float64(v[base+1]), float64(v[base+w]), float64(v[base+w+1])}
				slices.Sort(win[:])
				if win[3] > 0 && win[3]-win[2] < d {
					p.near[pl/(planes/p.rows)] = true
				}
			}
		}
	}
	p.Reference.MaxPool2(y, idx, x, planes, h, w)
}

// values is x on the host while recording, else nil.
func (p *margins) values(x engine.Buf) []float32 {
	if p.near == nil {
		return nil
	}
	v := make([]float32, x.N)
	if err := p.Reference.Download(v, x); err != nil {
		panic(err) // the reference device fails only on a programmer error
	}
	return v
}

func rms(v []float32) float64 {
	var s float64
	for _, x := range v {
		s += float64(x) * float64(x)
	}
	return math.Sqrt(s / float64(len(v)))
}

// clear redraws, from rng, the inputs of every sample of b whose forward pass on ref holds a
// decision within the margin, until none does, and returns how many it redrew.
func (p *margins) clear(t *testing.T, ref *engine.Net, b *data.Batch, rng *rand.Rand) int {
	t.Helper()
	redrawn := 0
	for round := 0; ; round++ {
		p.near = map[int]bool{}
		_, err := ref.Evaluate(b)
		near := p.near
		p.near = nil
		if err != nil {
			t.Fatal(err)
		}
		if len(near) == 0 {
			return redrawn
		}
		if round == 50 {
			t.Fatalf("after 50 rounds, %d samples still hold a decision within %g of its boundary", len(near), marginRel)
		}
		for _, s := range slices.Sorted(maps.Keys(near)) { // in order: the same draws every run
			x := b.X[s*b.SampleSize : (s+1)*b.SampleSize]
			for i := range x {
				x[i] = float32(rng.NormFloat64())
			}
		}
		redrawn += len(near)
	}
}

// dropUnit is the CUDA device with one planted error: the first ReLUGrad (the top hidden
// layer's) zeroes the element of dx with the largest magnitude, as if that unit's mask were
// wrong in that sample.
type dropUnit struct {
	*Device
	done bool
	err  error // of the download that found the unit
}

func (d *dropUnit) ReLUGrad(dx, dy, y engine.Buf) {
	d.Device.ReLUGrad(dx, dy, y)
	if d.done {
		return
	}
	d.done = true
	v := make([]float32, dx.N)
	if d.err = d.Device.Download(v, dx); d.err != nil {
		return
	}
	best := 0
	for i := range v {
		if math.Abs(float64(v[i])) > math.Abs(float64(v[best])) {
			best = i
		}
	}
	d.Device.Fill(dx.Slice(best, best+1), 0)
}

func evalBoth(t *testing.T, a, b *engine.Net, batch *data.Batch) (float64, float64) {
	t.Helper()
	ra, err := a.Evaluate(batch)
	if err != nil {
		t.Fatal(err)
	}
	rb, err := b.Evaluate(batch)
	if err != nil {
		t.Fatal(err)
	}
	return ra.LossSum, rb.LossSum
}

// TestDownloadAsync: copies queued behind kernels land in their destinations at WaitDownloads.
func TestDownloadAsync(t *testing.T) {
	for _, ty := range []engine.DType{engine.F32, engine.F16, engine.BF16} {
		b, err := dev.Malloc(3000, ty)
		if err != nil {
			t.Fatal(err)
		}
		dev.Fill(b, 1.5)
		got := make([]float32, 2000)
		dev.DownloadAsync(got[:1000], b.Slice(0, 1000))
		dev.Fill(b.Slice(1000, 3000), -2) // queued after the first copy was
		dev.DownloadAsync(got[1000:], b.Slice(1000, 2000))
		if err := dev.WaitDownloads(); err != nil {
			t.Fatal(err)
		}
		if got[0] != 1.5 || got[999] != 1.5 || got[1000] != -2 || got[1999] != -2 {
			t.Fatalf("%v: got %v %v %v %v", ty, got[0], got[999], got[1000], got[1999])
		}
		dev.Release(b)
	}
}
