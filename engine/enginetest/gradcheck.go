//go:build !cuda

package enginetest

// Layer-level gradient checks: each layer kind the engine has, in a tiny network ending in
// the softmax cross-entropy, run on a Device with the operations engine.Net maps it to, and
// compared with gorgonia's symbolic differentiation of the same network (in float64) and
// with central finite differences of a float64 forward pass.

import (
	"fmt"
	"math"
	"testing"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

	"github.com/qvd/qvd/engine"
)

// layerKind is a layer of a gradient-check network.
type layerKind int

const (
	dense      layerKind = iota // Gemm + AddBias; backward GemmLD by blocks of rows, SumRows, Gemm
	conv                        // Conv2D / Conv2DBackward
	convUnfold                  // the same through Im2Col, Gemm, AddBias, Transpose01 (engine.UnfoldConv2D)
	relu                        // ReLU in place / ReLUGrad in place
	maxPool                     // MaxPool2 / MaxPool2Grad
	flatten                     // nothing: NCHW is already rows × features
)

func (k layerKind) String() string {
	return [...]string{"dense", "conv", "conv(unfolded)", "relu", "maxpool2", "flatten"}[k]
}

// gcLayer is one layer: out units or channels, kernel and padding.
type gcLayer struct {
	kind       layerKind
	out, k, pd int
}

// gcNet is a network of n samples of shape in (features, or C×H×W) through layers into the
// mean softmax cross-entropy over its output's features.
type gcNet struct {
	name   string
	n      int
	in     []int
	layers []gcLayer
	// margin keeps every input at least this far from zero and from the other inputs of its
	// 2×2 window, so that no finite difference straddles ReLU's or max-pool's kink.
	margin float64
}

// prod is the number of elements of a shape.
func prod(s []int) int {
	p := 1
	for _, v := range s {
		p *= v
	}
	return p
}

// shapes returns each layer's input shape, and the output shape at the end.
func (g *gcNet) shapes() [][]int {
	s := [][]int{g.in}
	for _, l := range g.layers {
		in := s[len(s)-1]
		var out []int
		switch l.kind {
		case dense:
			out = []int{l.out}
		case conv, convUnfold:
			out = []int{l.out, in[1] + 2*l.pd - l.k + 1, in[2] + 2*l.pd - l.k + 1}
		case relu:
			out = in
		case maxPool:
			out = []int{in[0], in[1] / 2, in[2] / 2}
		case flatten:
			out = []int{prod(in)}
		}
		s = append(s, out)
	}
	return s
}

func (g *gcNet) convShape(i int) engine.ConvShape {
	in, l := g.shapes()[i], g.layers[i]
	return engine.ConvShape{N: g.n, C: in[0], H: in[1], W: in[2], Out: l.out, K: l.k, Pad: l.pd}
}

// paramShapes are the weight and bias shapes of layer i (none for layers without).
func (g *gcNet) paramShapes(i int) (w, b []int) {
	in, l := g.shapes()[i], g.layers[i]
	switch l.kind {
	case dense:
		return []int{in[0], l.out}, []int{l.out} // rows × features times In × Out, as model.Spec lays it out
	case conv, convUnfold:
		return []int{l.out, in[0], l.k, l.k}, []int{l.out}
	}
	return nil, nil
}

// gcValues are a network's inputs, parameters (weight then bias of each layer that has
// them) and labels.
type gcValues struct {
	x      []float32
	params [][]float32
	labels []int32
}

func (g *gcNet) values(h *harness) gcValues {
	var v gcValues
	nx := g.n * prod(g.in)
	if g.margin > 0 {
		// Distinct values at least 2·margin apart in random order, none within margin of zero.
		v.x = make([]float32, nx)
		for i, p := range h.rng.Perm(nx) {
			v.x[i] = float32((float64(p-nx/2) + 0.5) * 2 * g.margin)
		}
	} else {
		v.x = h.normal(nx, 1)
	}
	for i := range g.layers {
		ws, bs := g.paramShapes(i)
		if ws == nil {
			continue
		}
		fanIn := prod(ws[1:])
		if g.layers[i].kind == dense {
			fanIn = ws[0]
		}
		v.params = append(v.params, h.normal(prod(ws), 1/math.Sqrt(float64(fanIn))), h.normal(prod(bs), 0.3))
	}
	classes := prod(g.shapes()[len(g.layers)])
	v.labels = make([]int32, g.n)
	for i := range v.labels {
		v.labels[i] = int32(h.rng.IntN(classes))
	}
	return v
}

// forward64 is the network's mean loss in float64, from the definitions of its layers.
func (g *gcNet) forward64(x []float64, params [][]float64, labels []int32) float64 {
	shapes := g.shapes()
	hcur := x
	pi := 0
	for i, l := range g.layers {
		in, out := shapes[i], shapes[i+1]
		switch l.kind {
		case dense:
			w, b := params[pi], params[pi+1]
			pi += 2
			y := make([]float64, g.n*l.out)
			for r := range g.n {
				for o := range l.out {
					s := b[o]
					for j := range in[0] {
						s += hcur[r*in[0]+j] * w[j*l.out+o]
					}
					y[r*l.out+o] = s
				}
			}
			hcur = y
		case conv, convUnfold:
			w, b := params[pi], params[pi+1]
			pi += 2
			s := g.convShape(i)
			y := make([]float64, g.n*prod(out))
			ohw := s.OH() * s.OW()
			for j := range y {
				y[j] = b[(j/ohw)%s.Out]
			}
			taps(s, func(xi, wi, yi int) { y[yi] += hcur[xi] * w[wi] })
			hcur = y
		case relu:
			y := make([]float64, len(hcur))
			for j, v := range hcur {
				y[j] = max(v, 0)
			}
			hcur = y
		case maxPool:
			c, hh, w := in[0], in[1], in[2]
			oh, ow := hh/2, w/2
			y := make([]float64, g.n*c*oh*ow)
			for p := range g.n * c {
				for oy := range oh {
					for ox := range ow {
						at := p*hh*w + 2*oy*w + 2*ox
						m := hcur[at]
						for _, d := range []int{1, w, w + 1} {
							m = max(m, hcur[at+d])
						}
						y[(p*oh+oy)*ow+ox] = m
					}
				}
			}
			hcur = y
		case flatten:
		}
	}
	classes := len(hcur) / g.n
	var loss float64
	for r := range g.n {
		z := hcur[r*classes : (r+1)*classes]
		m := math.Inf(-1)
		for _, v := range z {
			m = max(m, v)
		}
		var s float64
		for _, v := range z {
			s += math.Exp(v - m)
		}
		loss += m + math.Log(s) - z[labels[r]]
	}
	return loss / float64(g.n)
}

// finiteDiff is the gradient of forward64 by central differences, for the input and every
// parameter.
func (g *gcNet) finiteDiff(v gcValues) (dx []float64, dparams [][]float64) {
	x := f64(v.x)
	params := make([][]float64, len(v.params))
	for i, p := range v.params {
		params[i] = f64(p)
	}
	grad := func(t []float64) []float64 {
		d := make([]float64, len(t))
		for i, orig := range t {
			const step = 1e-6
			t[i] = orig + step
			up := g.forward64(x, params, v.labels)
			t[i] = orig - step
			down := g.forward64(x, params, v.labels)
			t[i] = orig
			d[i] = (up - down) / (2 * step)
		}
		return d
	}
	dx = grad(x)
	for _, p := range params {
		dparams = append(dparams, grad(p))
	}
	return dx, dparams
}

// gorgonia builds the network as package model does (G.Mul, G.Conv2d, G.Rectify,
// G.MaxPool2D, G.Reshape, G.LogSoftMax), in float64, and returns its loss and the symbolic
// gradients of the input and every parameter.
func (g *gcNet) gorgonia(v gcValues) (loss float64, dx []float64, dparams [][]float64, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("gorgonia: %v", r)
		}
	}()
	gr := G.NewGraph()
	node := func(name string, vals []float32, shape ...int) *G.Node {
		t := tensor.New(tensor.WithShape(shape...), tensor.WithBacking(f64(vals)))
		return G.NewTensor(gr, G.Float64, len(shape), G.WithShape(shape...), G.WithName(name), G.WithValue(t))
	}
	x := node("x", v.x, append([]int{g.n}, g.in...)...)
	wrt := G.Nodes{x}
	h := x
	pi := 0
	for i, l := range g.layers {
		switch l.kind {
		case dense:
			ws, _ := g.paramShapes(i)
			w := node(fmt.Sprintf("w%d", i), v.params[pi], ws...)
			b := node(fmt.Sprintf("b%d", i), v.params[pi+1], 1, l.out)
			pi += 2
			wrt = append(wrt, w, b)
			h = G.Must(G.BroadcastAdd(G.Must(G.Mul(h, w)), b, nil, []byte{0}))
		case conv, convUnfold:
			ws, _ := g.paramShapes(i)
			w := node(fmt.Sprintf("w%d", i), v.params[pi], ws...)
			b := node(fmt.Sprintf("b%d", i), v.params[pi+1], 1, l.out, 1, 1)
			pi += 2
			wrt = append(wrt, w, b)
			h = G.Must(G.Conv2d(h, w, tensor.Shape{l.k, l.k}, []int{l.pd, l.pd}, []int{1, 1}, []int{1, 1}))
			h = G.Must(G.BroadcastAdd(h, b, nil, []byte{0, 2, 3}))
		case relu:
			h = G.Must(G.Rectify(h))
		case maxPool:
			h = G.Must(G.MaxPool2D(h, tensor.Shape{2, 2}, []int{0, 0}, []int{2, 2}))
		case flatten:
			if h.Shape().Dims() != 2 {
				h = G.Must(G.Reshape(h, tensor.Shape{g.n, prod(g.shapes()[i+1])}))
			}
		}
	}
	classes := prod(g.shapes()[len(g.layers)])
	onehot := make([]float32, g.n*classes)
	for r, y := range v.labels {
		onehot[r*classes+int(y)] = 1
	}
	y := node("y", onehot, g.n, classes)
	lsm := G.Must(G.LogSoftMax(h, 1))
	ce := G.Must(G.Neg(G.Must(G.Mean(G.Must(G.Sum(G.Must(G.HadamardProd(lsm, y)), 1))))))
	if _, err := G.Grad(ce, wrt...); err != nil {
		return 0, nil, nil, err
	}
	vm := G.NewTapeMachine(gr, G.BindDualValues(wrt...))
	defer vm.Close()
	if err := vm.RunAll(); err != nil {
		return 0, nil, nil, err
	}
	grad := func(n *G.Node) []float64 {
		gv, err := n.Grad()
		if err != nil {
			panic(err)
		}
		return append([]float64(nil), gv.Data().([]float64)...)
	}
	dx = grad(x)
	for _, n := range wrt[1:] {
		dparams = append(dparams, grad(n))
	}
	return ce.Value().Data().(float64), dx, dparams, nil
}

// onDevice runs the network forward and backward on h's device in fp32, layer by layer as
// engine.Net does, and returns the mean loss and the gradients of the input and every
// parameter.
func (g *gcNet) onDevice(h *harness, v gcValues) (loss float64, dx []float32, dparams [][]float32) {
	h.t.Helper()
	const dt = engine.F32
	shapes := g.shapes()
	rows := g.n
	x := h.alloc(len(v.x), dt)
	h.d.Upload(x, v.x)
	params := make([]engine.Buf, len(v.params))
	grads := make([]engine.Buf, len(v.params))
	for i, p := range v.params {
		params[i] = h.alloc(len(p), dt)
		h.d.Upload(params[i], p)
		grads[i] = h.alloc(len(p), dt)
		h.d.Upload(grads[i], nans(len(p)))
	}
	type state struct{ in, out, idx, ws engine.Buf }
	st := make([]state, len(g.layers))
	cur := x
	pi := 0
	for i, l := range g.layers {
		in, out := shapes[i], shapes[i+1]
		st[i].in = cur
		switch l.kind {
		case dense:
			y := h.alloc(rows*l.out, dt)
			h.d.Gemm(false, false, rows, l.out, in[0], 1, cur, params[pi], 0, y)
			h.d.AddBias(y, params[pi+1], rows, l.out, false)
			pi += 2
			cur = y
		case conv, convUnfold:
			s := g.convShape(i)
			y := h.alloc(rows*prod(out), dt)
			if l.kind == conv {
				st[i].ws = h.workspace(s, dt)
				h.d.Conv2D(y, cur, params[pi], params[pi+1], st[i].ws, s)
			} else {
				st[i].ws = h.alloc(engine.UnfoldWorkspace(s), dt)
				engine.UnfoldConv2D(h.d, y, cur, params[pi], params[pi+1], st[i].ws, s)
			}
			pi += 2
			cur = y
		case relu:
			h.d.ReLU(cur, cur) // in place, as the engine does
		case maxPool:
			y := h.alloc(rows*prod(out), dt)
			st[i].idx = h.alloc(rows*prod(out), engine.I32)
			h.d.MaxPool2(y, st[i].idx, cur, rows*in[0], in[1], in[2])
			cur = y
		case flatten:
		}
		st[i].out = cur
	}
	classes := prod(shapes[len(g.layers)])
	labels := h.alloc(rows, engine.I32)
	h.d.UploadInt32(labels, v.labels)
	losses := h.alloc(rows, engine.F32)
	// The engine writes dlogits over the logits, unless a ReLU's backward pass still needs
	// them as its output.
	dy := cur
	for i := len(g.layers) - 1; i >= 0 && g.layers[i].kind != dense && g.layers[i].kind != conv &&
		g.layers[i].kind != convUnfold && g.layers[i].kind != maxPool; i-- {
		if g.layers[i].kind == relu {
			dy = h.alloc(rows*classes, dt)
			break
		}
	}
	h.d.SoftmaxXent(dy, losses, cur, labels, rows, classes, 1/float32(rows))
	for _, l := range h.get(losses) {
		loss += float64(l)
	}
	loss /= float64(rows)

	for i := len(g.layers) - 1; i >= 0; i-- {
		l, in := g.layers[i], shapes[i]
		switch l.kind {
		case dense:
			pi -= 2
			// The weight gradient in two blocks of rows, as the engine computes it up to a
			// bucket boundary and from it: rows [r0, r1) are columns r0..r1 of the input
			// (transposed) times dy.
			for _, r := range [][2]int{{0, in[0] / 2}, {in[0] / 2, in[0]}} {
				r0, r1 := r[0], r[1]
				if r0 == r1 {
					continue
				}
				x := st[i].in.Slice(r0, r0+stridedLen(rows, r1-r0, in[0]))
				h.d.GemmLD(true, false, r1-r0, l.out, rows, 1, x, in[0], dy, l.out, 0, grads[pi].Slice(r0*l.out, r1*l.out), l.out)
			}
			h.d.SumRows(grads[pi+1], dy, rows, l.out, false, 0)
			d := h.alloc(rows*in[0], dt)
			h.d.Gemm(false, true, rows, in[0], l.out, 1, dy, params[pi], 0, d)
			dy = d
		case conv, convUnfold:
			pi -= 2
			s := g.convShape(i)
			d := h.alloc(rows*prod(in), dt)
			if l.kind == conv {
				h.d.Conv2DBackward(d, grads[pi], grads[pi+1], dy, st[i].in, params[pi], st[i].ws, s, 0)
			} else {
				engine.UnfoldConv2DBackward(h.d, d, grads[pi], grads[pi+1], dy, st[i].in, params[pi], st[i].ws, s, 0)
			}
			dy = d
		case relu:
			h.d.ReLUGrad(dy, dy, st[i].out)
		case maxPool:
			d := h.alloc(rows*prod(in), dt)
			h.d.MaxPool2Grad(d, dy, st[i].idx)
			dy = d
		case flatten:
		}
	}
	dx = h.get(dy)
	for _, b := range grads {
		dparams = append(dparams, h.get(b))
	}
	return loss, dx, dparams
}

// gcNets are the networks checked: each layer kind alone, then together.
var gcNets = []gcNet{
	{name: "dense", n: 3, in: []int{6}, layers: []gcLayer{{kind: dense, out: 4}}},
	{name: "conv k3 pad1", n: 2, in: []int{2, 5, 5}, layers: []gcLayer{{kind: conv, out: 3, k: 3, pd: 1}, {kind: flatten}}},
	{name: "conv k5 pad2", n: 3, in: []int{1, 4, 6}, layers: []gcLayer{{kind: conv, out: 2, k: 5, pd: 2}, {kind: flatten}}},
	{name: "conv k3 pad0", n: 17, in: []int{3, 5, 5}, layers: []gcLayer{{kind: conv, out: 2, k: 3}, {kind: flatten}}},
	{name: "conv k1", n: 2, in: []int{4, 3, 3}, layers: []gcLayer{{kind: conv, out: 3, k: 1}, {kind: flatten}}},
	{name: "unfolded conv k3 pad1", n: 2, in: []int{2, 5, 5}, layers: []gcLayer{{kind: convUnfold, out: 3, k: 3, pd: 1}, {kind: flatten}}},
	{name: "relu", n: 3, in: []int{8}, layers: []gcLayer{{kind: relu}}, margin: 0.05},
	{name: "maxpool2", n: 2, in: []int{2, 4, 6}, layers: []gcLayer{{kind: maxPool}, {kind: flatten}}, margin: 0.02},
	{name: "maxpool2 odd", n: 2, in: []int{1, 5, 7}, layers: []gcLayer{{kind: maxPool}, {kind: flatten}}, margin: 0.02},
	{name: "flatten", n: 2, in: []int{2, 3, 3}, layers: []gcLayer{{kind: flatten}}},
	{name: "softmax cross-entropy", n: 5, in: []int{7}},
	{name: "mlp", n: 4, in: []int{7}, layers: []gcLayer{{kind: dense, out: 6}, {kind: relu}, {kind: dense, out: 3}}},
	{name: "cnn", n: 3, in: []int{2, 6, 6}, layers: []gcLayer{
		{kind: conv, out: 3, k: 3, pd: 1}, {kind: relu}, {kind: maxPool},
		{kind: convUnfold, out: 4, k: 3, pd: 1}, {kind: relu}, {kind: flatten}, {kind: dense, out: 5}}},
}

// TestLayerGradients checks every layer kind's forward and backward pass on devices made by
// newDevice (in fp32): the loss against a float64 forward pass and gorgonia's, and the
// gradients of the input and of every weight and bias against gorgonia's symbolic gradients
// and central finite differences (which also check gorgonia).
func TestLayerGradients(t *testing.T, newDevice NewDevice) {
	for _, g := range gcNets {
		t.Run(g.name, func(t *testing.T) {
			h := newHarness(t, newDevice)
			v := g.values(h)
			gLoss, gDX, gParams, err := g.gorgonia(v)
			if err != nil {
				t.Fatal(err)
			}
			fdX, fdParams := g.finiteDiff(v)
			params := make([][]float64, len(v.params))
			for i, p := range v.params {
				params[i] = f64(p)
			}
			loss64 := g.forward64(f64(v.x), params, v.labels)
			dLoss, dDX, dParams := g.onDevice(h, v)

			if math.Abs(gLoss-loss64) > 1e-12*math.Abs(loss64) {
				t.Errorf("gorgonia's loss %v, the float64 forward pass's %v", gLoss, loss64)
			}
			if math.Abs(dLoss-loss64) > 1e-5*math.Abs(loss64) {
				t.Errorf("the device's loss %v, the float64 forward pass's %v", dLoss, loss64)
			}
			names := []string{"input"}
			for i, l := range g.layers {
				if ws, _ := g.paramShapes(i); ws != nil {
					names = append(names, fmt.Sprintf("%v layer %d weights", l.kind, i), fmt.Sprintf("%v layer %d bias", l.kind, i))
				}
			}
			compare := func(what string, got, want []float64, rel float64) {
				t.Helper()
				var scale float64
				for _, v := range want {
					scale = max(scale, math.Abs(v))
				}
				e := rel*scale + 1e-9
				for i := range want {
					if d := math.Abs(got[i] - want[i]); !(d <= e) {
						t.Errorf("%s: element %d of %d is %v, want %v (off by %.3g, tolerance %.3g)", what, i, len(want), got[i], want[i], d, e)
						return
					}
				}
			}
			for i, name := range names {
				gg, fd, dev := gDX, fdX, f64(dDX)
				if i > 0 {
					gg, fd, dev = gParams[i-1], fdParams[i-1], f64(dParams[i-1])
				}
				compare("gorgonia vs finite differences: "+name, gg, fd, 1e-6)
				compare("device vs gorgonia: "+name, dev, gg, 1e-5)
				compare("device vs finite differences: "+name, dev, fd, 1e-5)
			}
		})
	}
}
