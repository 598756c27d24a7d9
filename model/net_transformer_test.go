//go:build !cuda

package model

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

// Tests of the gorgonia engine's graphs of the transformer-era layers (net_layers.go): their
// forward passes against the plain-Go Forward, their gradients against finite differences,
// checkpointing and freezing.

func tfIntp(v int) *int { return &v }

// tfViT and tfLayers are the small models of these tests (and of engine's comparison).
var (
	tfViT     = Config{Type: TypeViT, Patch: 2, Dim: 8, Depth: 2, Heads: 2, MLPRatio: 2}
	tfViTDrop = Config{Type: TypeViT, Patch: 2, Dim: 8, Depth: 2, Heads: 2, MLPRatio: 2, Dropout: 0.1}
	tfLayers  = Config{Type: TypeLayers, Layers: []LayerConfig{
		{Type: "batchnorm2d"},
		{Type: "conv2d", Out: 4, Kernel: 3},
		{Type: "residual", Layers: []LayerConfig{
			{Type: "relu"}, {Type: "batchnorm2d"}, {Type: "conv2d", Out: 4, Kernel: 3, Pad: tfIntp(1)}, {Type: "relu"},
		}},
		{Type: "mean_pool"},
		{Type: "residual", Layers: []LayerConfig{
			{Type: "layernorm"}, {Type: "dense", Out: 8}, {Type: "gelu"}, {Type: "dropout", P: 0.2}, {Type: "dense", Out: 4},
		}},
		{Type: "dense"},
	}}
)

// tfTokens is a `layers:` transformer without a class token's pooling: its tokens are
// averaged (mean_pool over [T, D]) after two pre-norm blocks.
var tfTokens = Config{Type: TypeLayers, Layers: []LayerConfig{
	{Type: "patch_embed", Out: 8, Patch: 2},
	{Type: "tokens"},
	{Type: "block", Layers: []LayerConfig{
		{Type: "residual", Layers: []LayerConfig{{Type: "layernorm"}, {Type: "attention", Heads: 4}}},
		{Type: "residual", Layers: []LayerConfig{{Type: "layernorm"}, {Type: "dense", Out: 12}, {Type: "gelu"}, {Type: "dense", Out: 8}}},
	}},
	{Type: "block", Layers: []LayerConfig{
		{Type: "residual", Layers: []LayerConfig{{Type: "layernorm"}, {Type: "attention", Heads: 1}, {Type: "dropout", P: 0.3}}},
	}},
	{Type: "layernorm"},
	{Type: "mean_pool"},
	{Type: "dense"},
}}

// newTfNet builds a gorgonia Net of cfg on input, with frozen (a ratio, 0 for none) and
// segments, its parameters from Init(seed 7) with the layer norms' and batch norms' scales
// and shifts perturbed (so that their gradients are not degenerate) and the running
// statistics set to something other than the identity.
func newTfNet(t *testing.T, cfg Config, input []int, micro int, f half.Format, ratio float64, segments int) *Net {
	t.Helper()
	spec, err := NewSpec(cfg, input, 4)
	if err != nil {
		t.Fatal(err)
	}
	var frozen func(string) bool
	if ratio > 0 {
		if frozen, err = (FreezeConfig{Ratio: ratio}).Frozen(spec); err != nil {
			t.Fatal(err)
		}
	}
	layout := NewLayoutFrozen(spec, frozen)
	params := make([]float32, layout.Size)
	Init(spec, layout, params, 7)
	tfPerturb(spec, layout, params, 5)
	net, err := New(spec, layout, params, Options{MicroBatch: micro, EvalBatch: micro, Grad: f, Segments: segments})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { net.Close() })
	return net
}

// tfPerturb moves the normalisation layers' parameters and buffers off their initial values,
// and the class token and position embeddings off their N(0, 0.02²) (the class token's row
// would otherwise have a tiny variance, which its layer norm turns into a curvature that
// finite differences of any usable step cannot follow).
func tfPerturb(spec *Spec, layout *Layout, params []float32, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 3))
	for _, tt := range layout.Tensors {
		k := spec.Layers[tt.Layer].Kind
		if k != LayerNorm && k != BatchNorm2d && k != Tokens {
			continue
		}
		for i := tt.Offset; i < tt.Offset+tt.Size; i++ {
			v := float32(0.2 * (rng.Float64()*2 - 1))
			if k == Tokens {
				v *= 3
			}
			if tt.Name[len(tt.Name)-3:] == "var" {
				v = 0.5 + float32(rng.Float64())
			}
			params[i] += v
		}
	}
}

// TestTransformerForwardMatchesPlain: the evaluation graph's logits equal Forward's (plain
// Go, float64 statistics) for the new layer kinds.
func TestTransformerForwardMatchesPlain(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   Config
		input []int
	}{
		{"vit", tfViTDrop, []int{3, 4, 4}},
		{"vit-gray", tfViT, []int{1, 4, 4}},
		{"layers", tfLayers, []int{2, 5, 5}},
		{"tokens", tfTokens, []int{2, 6, 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const micro = 3
			net := newTfNet(t, tc.cfg, tc.input, micro, half.FP32, 0, 0)
			size := prod(tc.input)
			b := randomBatch(micro, size, 4, 2)
			// A training step first, which moves the running statistics.
			g := make([]float32, net.Layout().Trainable())
			if _, err := net.ForwardBackward(b, 1, FlatSink(g)); err != nil {
				t.Fatal(err)
			}
			if _, err := net.Evaluate(b); err != nil {
				t.Fatal(err)
			}
			got := net.eval.logitV.Data().([]float32)
			want := make([]float32, micro*4)
			if err := Forward(want, net.Spec(), net.Layout(), net.Params(), b.X, micro); err != nil {
				t.Fatal(err)
			}
			if e := tfMaxRelErr(want, got); e > 2e-6 {
				t.Errorf("logits: gorgonia %v, plain %v (relative error %.3g)", got, want, e)
			}
		})
	}
}

func tfMaxRelErr(want, got []float32) float64 {
	var d, m float64
	for i := range want {
		d = math.Max(d, math.Abs(float64(want[i])-float64(got[i])))
		m = math.Max(m, math.Abs(float64(want[i])))
	}
	return d / math.Max(m, 1e-30)
}

// TestTransformerGradientFiniteDifference checks the training graph's gradients (dropout
// masks and batch statistics included) against central differences of its own loss.
func TestTransformerGradientFiniteDifference(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   Config
		input []int
	}{
		{"vit", tfViTDrop, []int{3, 4, 4}},
		{"layers", tfLayers, []int{2, 5, 5}},
		{"tokens", tfTokens, []int{2, 6, 4}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const micro = 4
			net := newTfNet(t, tc.cfg, tc.input, micro, half.FP32, 0, 0)
			net.SetDropoutSeed(77)
			b := randomBatch(micro, prod(tc.input), 4, 3)
			params, layout := net.Params(), net.Layout()
			grads := make([]float32, layout.Trainable())
			if _, err := net.ForwardBackward(b, 1, FlatSink(grads)); err != nil {
				t.Fatal(err)
			}
			scratch := make([]float32, layout.Trainable())
			loss := func() float64 {
				l, err := net.ForwardBackward(b, 1, FlatSink(scratch))
				if err != nil {
					t.Fatal(err)
				}
				return float64(l)
			}
			rng := rand.New(rand.NewPCG(9, 9))
			for _, ts := range layout.Tensors {
				if ts.Frozen {
					continue
				}
				for k := 0; k < 4; k++ {
					i := ts.Offset + rng.IntN(ts.Size)
					const h = 3e-3
					orig := params[i]
					params[i] = orig + h
					up := loss()
					params[i] = orig - h
					down := loss()
					params[i] = orig
					fd := (up - down) / (2 * h)
					g := float64(grads[i-layout.Frozen])
					if math.Abs(fd-g) > 3e-4+0.03*math.Abs(fd) {
						t.Errorf("%s[%d]: analytic %.6g, finite difference %.6g", ts.Name, i-ts.Offset, g, fd)
					}
				}
			}
		})
	}
}

// TestTransformerCheckpointing: with activation checkpointing the losses, gradients and
// running statistics are the plain graph's bit for bit, frozen tensors or not.
func TestTransformerCheckpointing(t *testing.T) {
	for _, tc := range []struct {
		name  string
		cfg   Config
		input []int
		ratio float64
	}{
		{"vit", tfViTDrop, []int{3, 4, 4}, 0},
		{"vit-frozen", tfViTDrop, []int{3, 4, 4}, 0.5},
		{"layers", tfLayers, []int{2, 5, 5}, 0},
		{"layers-frozen", tfLayers, []int{2, 5, 5}, 0.5},
		{"tokens-frozen", tfTokens, []int{2, 6, 4}, 0.5},
	} {
		for _, k := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/k%d", tc.name, k), func(t *testing.T) {
				const micro = 3
				plain := newTfNet(t, tc.cfg, tc.input, micro, half.FP32, tc.ratio, 0)
				ckpt := newTfNet(t, tc.cfg, tc.input, micro, half.FP32, tc.ratio, k)
				if ckpt.recompute == nil || len(ckpt.recompute.segs) != k {
					t.Fatalf("not checkpointed with %d segments", k)
				}
				n := plain.Layout().Trainable()
				gp, gc := make([]float32, n), make([]float32, n)
				for i, scale := range []float32{1, 1024} {
					b := randomBatch(micro, prod(tc.input), 4, uint64(11+i))
					plain.SetDropoutSeed(uint64(5 + i))
					ckpt.SetDropoutSeed(uint64(5 + i))
					lp, err := plain.ForwardBackward(b, scale, FlatSink(gp))
					if err != nil {
						t.Fatal(err)
					}
					lc, err := ckpt.ForwardBackward(b, scale, FlatSink(gc))
					if err != nil {
						t.Fatal(err)
					}
					if math.Float32bits(lp) != math.Float32bits(lc) {
						t.Errorf("batch %d: loss %v, checkpointed %v", i, lp, lc)
					}
				}
				nonzero := 0
				for i := range gp {
					if math.Float32bits(gp[i]) != math.Float32bits(gc[i]) {
						t.Fatalf("gradient[%d]: plain %v, checkpointed %v", i, gp[i], gc[i])
					}
					if gp[i] != 0 {
						nonzero++
					}
				}
				if nonzero == 0 {
					t.Fatal("all gradients are zero")
				}
				for i, v := range plain.Params() {
					if math.Float32bits(v) != math.Float32bits(ckpt.Params()[i]) {
						t.Fatalf("params[%d] (running statistics): plain %v, checkpointed %v", i, v, ckpt.Params()[i])
					}
				}
				// Every trainable tensor gets a gradient; no frozen one does (it has no place).
				for _, ts := range plain.Layout().Tensors {
					if ts.Frozen {
						continue
					}
					nz := false
					for _, v := range gc[ts.Offset-plain.Layout().Frozen:][:ts.Size] {
						nz = nz || v != 0
					}
					if !nz {
						t.Errorf("%s: all-zero gradient", ts.Name)
					}
				}
			})
		}
	}
}

// TestDropoutMasks: a dropout layer's mask is DropoutKeep's over the micro-batch's elements,
// changes with the seed, and is the identity in evaluation.
func TestDropoutMasks(t *testing.T) {
	net := newTfNet(t, tfViTDrop, []int{3, 4, 4}, 2, half.FP32, 0, 0)
	b := randomBatch(2, 48, 4, 1)
	g := make([]float32, net.Layout().Trainable())
	run := func(seed uint64) float32 {
		net.SetDropoutSeed(seed)
		l, err := net.ForwardBackward(b, 1, FlatSink(g))
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	l1, l2, l1again := run(1), run(2), run(1)
	if l1 == l2 || l1 != l1again {
		t.Errorf("losses with seeds 1, 2, 1: %v %v %v", l1, l2, l1again)
	}
	if len(net.masks) == 0 {
		t.Fatal("no dropout masks")
	}
	for i, m := range net.masks {
		if net.Spec().Layers[i].Kind != Dropout {
			t.Fatalf("mask of layer %d (%v)", i, net.Spec().Layers[i].Kind)
		}
		zeros := 0
		for j, v := range m.buf {
			keep := DropoutKeep(LayerSeed(1, i), uint64(j), m.p)
			if (v != 0) != keep || (keep && v != 1/(1-m.p)) {
				t.Fatalf("layer %d mask[%d] = %v, keep %v", i, j, v, keep)
			}
			if v == 0 {
				zeros++
			}
		}
		if f := float64(zeros) / float64(len(m.buf)); f < 0.02 || f > 0.25 {
			t.Errorf("layer %d: %.2f of the mask dropped, p %v", i, f, m.p)
		}
	}
	// Evaluation ignores dropout: the no-dropout model with the same weights evaluates alike.
	plain := newTfNet(t, tfViT, []int{3, 4, 4}, 2, half.FP32, 0, 0)
	copy(plain.Params(), net.Params())
	r1, err1 := net.Evaluate(b)
	r2, err2 := plain.Evaluate(b)
	if err1 != nil || err2 != nil || r1.LossSum != r2.LossSum {
		t.Errorf("evaluation with dropout %v, without %v (%v, %v)", r1, r2, err1, err2)
	}
}

// TestBatchNormRunningStatistics: a training run moves the running statistics as PyTorch's
// BatchNorm2d does (momentum 0.1, unbiased variance).
func TestBatchNormRunningStatistics(t *testing.T) {
	cfg := Config{Type: TypeLayers, Layers: []LayerConfig{{Type: "batchnorm2d"}, {Type: "flatten"}, {Type: "dense"}}}
	const micro = 3
	net := newTfNet(t, cfg, []int{2, 3, 3}, micro, half.FP32, 0, 0)
	l := net.Spec().Layers[0]
	rm, rv := net.Layout().Tensors[l.RunMean], net.Layout().Tensors[l.RunVar]
	p := net.Params()
	before := append([]float32(nil), p...)
	b := randomBatch(micro, 18, 4, 4)
	g := make([]float32, net.Layout().Trainable())
	if _, err := net.ForwardBackward(b, 1, FlatSink(g)); err != nil {
		t.Fatal(err)
	}
	for c := 0; c < 2; c++ {
		var xs []float64
		for s := 0; s < micro; s++ {
			for _, v := range b.X[(s*2+c)*9:][:9] {
				xs = append(xs, float64(v))
			}
		}
		var mean, vari float64
		for _, v := range xs {
			mean += v
		}
		mean /= float64(len(xs))
		for _, v := range xs {
			vari += (v - mean) * (v - mean)
		}
		vari /= float64(len(xs) - 1)
		wm := 0.9*float64(before[rm.Offset+c]) + 0.1*mean
		wv := 0.9*float64(before[rv.Offset+c]) + 0.1*vari
		if math.Abs(float64(p[rm.Offset+c])-wm) > 1e-6 || math.Abs(float64(p[rv.Offset+c])-wv) > 1e-6 {
			t.Errorf("channel %d: running mean %v var %v, want %v %v", c, p[rm.Offset+c], p[rv.Offset+c], wm, wv)
		}
	}
	// Evaluation does not move them.
	after := append([]float32(nil), p...)
	if _, err := net.Evaluate(b); err != nil {
		t.Fatal(err)
	}
	for i := range after {
		if after[i] != p[i] {
			t.Fatalf("evaluation changed params[%d]", i)
		}
	}
}
