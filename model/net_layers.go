//go:build !cuda

package model

import (
	"fmt"
	"hash"
	"hash/fnv"
	"math"

	"github.com/chewxy/hm"
	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// The gorgonia graphs of the transformer-era layer kinds (LayerNorm, GELU, Dropout, residual
// branches, PatchEmbed, Tokens, Attention, ClassPool, MeanPool, BatchNorm2d), composed from
// gorgonia's own operations so that gorgonia's symbolic differentiation gives their backward
// passes: the gorgonia engine is the oracle the native engine's hand-written backward passes
// are tested against (engine/net_test.go), so nothing here shares code with engine/.
//
// Sequences [T, D] travel through the graph as [N·T, D] matrices (what Dense's matrix
// product and LayerNorm's row statistics want) or as [N, T, D] (Tokens, Attention, the
// pools); every layer reshapes its input to the form it needs (reshapeTo: nothing when the
// shape already matches, a copy otherwise).
//
// Two defects of gorgonia v0.9.18 shape the compositions, both caught by this package's
// finite-difference tests: Reshape aliases its input's memory behind the tape machine's back
// (reshapeOp), and InverseSqrt's symbolic derivative is wrong (rsqrt). Its softmax also
// shifts every row by the tensor's first element instead of the row's maximum, which is exact
// in arithmetic and only matters once scores differ by ~80 (exp overflows).

// graphCtx is what addLayers needs besides the layers themselves.
type graphCtx struct {
	g     *G.ExprGraph
	bs    int
	first int  // the index in Spec.Layers of the first layer added
	train bool // a training graph: dropout masks, batch norm's batch statistics
	// stats: read batch norm's batch statistics for the running statistics' update (false
	// in a checkpointed segment's recomputation, which must not update them twice).
	stats bool
	// param makes the node viewing tensor ti of the flat buffer, in the given shape.
	param func(ti int, shape ...int) *G.Node
	// mask returns the mask buffer of dropout layer i (an index in Spec.Layers) for a
	// training graph: bs × the layer's elements, refilled before every run.
	mask func(i int) []float32
	// reads collects the batch statistics the graph reads (stats true).
	reads []*bnRead
}

// bnRead is a BatchNorm2d layer's batch mean and biased variance, read out of a training
// run for the running statistics' update.
type bnRead struct {
	layer      int
	mean, vari G.Value
	count      int // elements per channel: N·H·W
}

// reshapeTo returns h in the given shape (h itself when it has it already), as a copy: see
// reshapeOp.
func reshapeTo(h *G.Node, shape ...int) *G.Node {
	if h.Shape().Eq(tensor.Shape(shape)) {
		return h
	}
	return G.Must(G.ApplyOp(reshapeOp{from: h.Shape().Clone(), to: tensor.Shape(shape).Clone()}, h))
}

// reshapeOp is a reshape that copies. gorgonia's own Reshape returns, when its input is
// still live, a shallow clone sharing the input's memory, while the tape machine's register
// allocator takes the result for memory of its own: an operation that later works in place
// on the result (the backward pass does so freely once a value is dead) then overwrites the
// input, which another node still reads. Seen here as wrong batch norm gradients: the
// reshaped variance [C] → [1, C, 1, 1] was overwritten by a gradient product while the
// derivative of the variance's mean still read it. A copy has no such alias.
type reshapeOp struct{ from, to tensor.Shape }

func (op reshapeOp) Arity() int { return 1 }

func (op reshapeOp) Type() hm.Type {
	a := hm.TypeVariable('a')
	return hm.NewFnType(G.TensorType{Dims: op.from.Dims(), Of: a}, G.TensorType{Dims: op.to.Dims(), Of: a})
}

func (op reshapeOp) InferShape(...G.DimSizer) (tensor.Shape, error) { return op.to.Clone(), nil }

func (op reshapeOp) Do(in ...G.Value) (G.Value, error) {
	x, ok := in[0].(*tensor.Dense)
	if !ok || len(in) != 1 {
		return nil, fmt.Errorf("reshape: input of type %T", in[0])
	}
	if !x.Shape().Eq(op.from) {
		return nil, fmt.Errorf("reshape: input of shape %v, want %v", x.Shape(), op.from)
	}
	y := x.Materialize().(*tensor.Dense) // a copy of a view, the tensor itself otherwise
	if y == x {
		y = x.Clone().(*tensor.Dense)
	}
	if err := y.Reshape(op.to...); err != nil {
		return nil, err
	}
	return y, nil
}

func (op reshapeOp) ReturnsPtr() bool      { return false }
func (op reshapeOp) CallsExtern() bool     { return false }
func (op reshapeOp) OverwritesInput() int  { return -1 }
func (op reshapeOp) WriteHash(h hash.Hash) { fmt.Fprintf(h, "reshape-copy %v→%v", op.from, op.to) }
func (op reshapeOp) Hashcode() uint32 {
	h := fnv.New32a()
	op.WriteHash(h)
	return h.Sum32()
}
func (op reshapeOp) String() string     { return fmt.Sprintf("ReshapeCopy%v", op.to) }
func (op reshapeOp) DiffWRT(int) []bool { return []bool{true} }

func (op reshapeOp) SymDiff(in G.Nodes, out, grad *G.Node) (G.Nodes, error) {
	g, err := G.ApplyOp(reshapeOp{from: op.to, to: op.from}, grad)
	return G.Nodes{g}, err
}

// rsqrt is 1/√v as Inverse(Sqrt(v)): gorgonia v0.9.18's InverseSqrt has a wrong symbolic
// derivative (−g/(2y³) where d(v^−½)/dv·g is −g·y³/2, y = v^−½), which finite differences
// catch (TestTransformerGradientFiniteDifference); Sqrt's and Inverse's are right.
func rsqrt(v *G.Node) *G.Node { return G.Must(G.Inverse(G.Must(G.Sqrt(v)))) }

// scalar is a float32 constant.
func scalar(v float64) *G.Node { return G.NewConstant(float32(v)) }

// addNewLayer appends layer l (the i-th of Spec.Layers) of a kind the MLP and CNN graphs do
// not use; skips is the stack of the open residual branches' inputs.
func (c *graphCtx) addNewLayer(h *G.Node, i int, l Layer, skips *[]*G.Node) (*G.Node, error) {
	bs := c.bs
	switch l.Kind {
	case LayerNorm:
		r, d := bs*l.Rows(), l.Out
		x := reshapeTo(h, r, d)
		mean := reshapeTo(G.Must(G.Mean(x, 1)), r, 1)
		xc := G.Must(G.BroadcastSub(x, mean, nil, []byte{1}))
		vari := reshapeTo(G.Must(G.Mean(G.Must(G.Square(xc)), 1)), r, 1)
		rstd := rsqrt(G.Must(G.Add(vari, scalar(float64(l.Eps)))))
		xhat := G.Must(G.BroadcastHadamardProd(xc, rstd, nil, []byte{1}))
		gamma := c.param(l.Weight, 1, d)
		beta := c.param(l.Bias, 1, d)
		y := G.Must(G.BroadcastHadamardProd(xhat, gamma, nil, []byte{0}))
		return G.Must(G.BroadcastAdd(y, beta, nil, []byte{0})), nil
	case GELU:
		// x·Φ(x), Φ(x) = (1 + erf(x/√2))/2: gorgonia has no erf, so erfOp adds one, whose
		// derivative 2/√π·exp(−u²) is composed from gorgonia's operations.
		u := G.Must(G.Mul(h, scalar(1/math.Sqrt2)))
		e := G.Must(G.ApplyOp(erfOp{}, u))
		phi := G.Must(G.Mul(G.Must(G.Add(e, scalar(1))), scalar(0.5)))
		return G.Must(G.HadamardProd(h, phi)), nil
	case Dropout:
		if !c.train {
			return h, nil
		}
		buf := c.mask(i)
		shape := h.Shape().Clone()
		if shape.TotalSize() != len(buf) {
			return nil, fmt.Errorf("layer %d (dropout): %d mask values for a %v input", i, len(buf), shape)
		}
		m := G.NewTensor(c.g, G.Float32, shape.Dims(), G.WithShape(shape...), G.WithName(fmt.Sprintf("dropout%d_mask", i)),
			G.WithValue(tensor.New(tensor.WithShape(shape...), tensor.WithBacking(buf))))
		return G.Must(G.HadamardProd(h, m)), nil
	case Residual:
		// h now has two readers, the branch and the Add: nothing may alias it (reshapeTo
		// copies, see reshapeOp).
		*skips = append(*skips, h)
		return h, nil
	case Add:
		if len(*skips) == 0 {
			return nil, fmt.Errorf("layer %d: add without its residual", i)
		}
		skip := (*skips)[len(*skips)-1]
		*skips = (*skips)[:len(*skips)-1]
		return G.Must(G.Add(reshapeTo(h, skip.Shape()...), skip)), nil
	case PatchEmbed:
		p, t, d := l.Patch, l.OutShape[0], l.Out
		w := c.param(l.Weight, d, l.In, p, p)
		b := c.param(l.Bias, 1, d, 1, 1)
		x := reshapeTo(h, append([]int{bs}, l.InShape...)...)
		y := G.Must(G.Conv2d(x, w, tensor.Shape{p, p}, []int{0, 0}, []int{p, p}, []int{1, 1}))
		y = G.Must(G.BroadcastAdd(y, b, nil, []byte{0, 2, 3}))
		// [N, D, H/p, W/p] → [N, D, T] → [N, T, D]: the patches in raster order.
		return G.Must(G.Transpose(reshapeTo(y, bs, d, t), 0, 2, 1)), nil
	case Tokens:
		t, d := l.InShape[0], l.InShape[1]
		x := reshapeTo(h, bs, t, d)
		cls := c.param(l.Weight, 1, 1, d)
		pos := c.param(l.Bias, 1, t+1, d)
		if bs > 1 {
			zeros := G.NewTensor(c.g, G.Float32, 3, G.WithShape(bs, 1, d), G.WithName(fmt.Sprintf("tokens%d_zeros", i)),
				G.WithValue(tensor.New(tensor.WithShape(bs, 1, d), tensor.Of(tensor.Float32))))
			cls = G.Must(G.BroadcastAdd(zeros, cls, nil, []byte{0}))
		}
		y := G.Must(G.Concat(1, cls, x))
		if bs > 1 {
			return G.Must(G.BroadcastAdd(y, pos, nil, []byte{0})), nil
		}
		return G.Must(G.Add(y, pos)), nil
	case Attention:
		t, d, heads := l.InShape[0], l.Out, l.Heads
		dh := d / heads
		// [N, T, 3, H, dh] → [3, N, H, T, dh]: Q, K and V, each head's a [T, dh] matrix.
		qkv := G.Must(G.Transpose(reshapeTo(h, bs, t, 3, heads, dh), 2, 0, 3, 1, 4))
		qkv = reshapeTo(qkv, 3, bs*heads, t, dh)
		q := G.Must(G.Slice(qkv, G.S(0)))
		k := G.Must(G.Slice(qkv, G.S(1)))
		v := G.Must(G.Slice(qkv, G.S(2)))
		s := G.Must(G.BatchedMatMul(q, k, false, true)) // [N·H, T, T]
		s = G.Must(G.Mul(s, scalar(1/math.Sqrt(float64(dh)))))
		pr := G.Must(G.SoftMax(s, 2))
		o := G.Must(G.BatchedMatMul(pr, v)) // [N·H, T, dh]
		// [N, H, T, dh] → [N, T, H, dh]: the heads side by side.
		o = G.Must(G.Transpose(reshapeTo(o, bs, heads, t, dh), 0, 2, 1, 3))
		return reshapeTo(o, bs*t, d), nil
	case ClassPool:
		t, d := l.InShape[0], l.InShape[1]
		return G.Must(G.Slice(reshapeTo(h, bs, t, d), nil, G.S(0))), nil
	case MeanPool:
		if len(l.InShape) == 3 {
			ch, hw := l.InShape[0], l.InShape[1]*l.InShape[2]
			return G.Must(G.Mean(reshapeTo(h, bs, ch, hw), 2)), nil
		}
		t, d := l.InShape[0], l.InShape[1]
		return G.Must(G.Mean(reshapeTo(h, bs, t, d), 1)), nil
	case BatchNorm2d:
		return c.batchNorm(h, i, l), nil
	}
	return nil, fmt.Errorf("layer kind %v not supported", l.Kind)
}

// batchNorm is BatchNorm2d: y = (x − μ)·rstd·γ + β per channel, with the batch's mean and
// biased variance in a training graph (read out for the running statistics when c.stats)
// and the running statistics in an evaluation graph.
func (c *graphCtx) batchNorm(h *G.Node, i int, l Layer) *G.Node {
	ch, hw := l.InShape[0], l.InShape[1]*l.InShape[2]
	x := reshapeTo(h, append([]int{c.bs}, l.InShape...)...)
	bcast := []byte{0, 2, 3}
	var mean, rstd *G.Node
	if c.train {
		// The mean over the batch and the pixels, one axis at a time: [N, C, HW] → [N, C] → [C].
		x3 := reshapeTo(x, c.bs, ch, hw)
		m := G.Must(G.Mean(G.Must(G.Mean(x3, 2)), 0))
		mean = reshapeTo(m, 1, ch, 1, 1)
		xc := G.Must(G.BroadcastSub(x, mean, nil, bcast))
		v := G.Must(G.Mean(G.Must(G.Mean(reshapeTo(G.Must(G.Square(xc)), c.bs, ch, hw), 2)), 0))
		if c.stats {
			r := &bnRead{layer: i, count: c.bs * hw}
			G.Read(m, &r.mean)
			G.Read(v, &r.vari)
			c.reads = append(c.reads, r)
		}
		rstd = reshapeTo(rsqrt(G.Must(G.Add(v, scalar(float64(l.Eps))))), 1, ch, 1, 1)
		return c.affine(G.Must(G.BroadcastHadamardProd(xc, rstd, nil, bcast)), l)
	}
	mean = c.param(l.RunMean, 1, ch, 1, 1)
	rstd = rsqrt(G.Must(G.Add(c.param(l.RunVar, 1, ch, 1, 1), scalar(float64(l.Eps)))))
	xc := G.Must(G.BroadcastSub(x, mean, nil, bcast))
	return c.affine(G.Must(G.BroadcastHadamardProd(xc, rstd, nil, bcast)), l)
}

// affine is batch norm's x̂·γ + β per channel.
func (c *graphCtx) affine(xhat *G.Node, l Layer) *G.Node {
	ch, bcast := l.InShape[0], []byte{0, 2, 3}
	y := G.Must(G.BroadcastHadamardProd(xhat, c.param(l.Weight, 1, ch, 1, 1), nil, bcast))
	return G.Must(G.BroadcastAdd(y, c.param(l.Bias, 1, ch, 1, 1), nil, bcast))
}

// updateRunning applies a training run's batch statistics to the running statistics in
// params, as PyTorch does: r ← (1 − momentum)·r + momentum·batch, the variance's batch value
// the unbiased one (× count/(count − 1)).
func updateRunning(spec *Spec, layout *Layout, params []float32, reads []*bnRead) error {
	for _, r := range reads {
		l := spec.Layers[r.layer]
		m, ok1 := valueData(r.mean)
		v, ok2 := valueData(r.vari)
		if !ok1 || !ok2 || len(m) != l.Out || len(v) != l.Out {
			return fmt.Errorf("model: layer %d (batchnorm2d): batch statistics not read", r.layer)
		}
		rm, rv := layout.Tensors[l.RunMean], layout.Tensors[l.RunVar]
		runMean, runVar := params[rm.Offset:rm.Offset+rm.Size], params[rv.Offset:rv.Offset+rv.Size]
		mom, cnt := float64(l.Momentum), float64(r.count)
		for j := range runMean {
			vu := float64(v[j])
			if cnt > 1 {
				vu *= cnt / (cnt - 1)
			}
			runMean[j] = float32((1-mom)*float64(runMean[j]) + mom*float64(m[j]))
			runVar[j] = float32((1-mom)*float64(runVar[j]) + mom*vu)
		}
	}
	return nil
}

// valueData is a read value's float32 data.
func valueData(v G.Value) ([]float32, bool) {
	if v == nil {
		return nil, false
	}
	d, ok := v.Data().([]float32)
	return d, ok
}

// dropMask is a dropout layer's mask for the training graphs: keep/(1 − p) per element of
// the micro-batch's input to the layer, a function of the pass's seed (DropoutKeep with
// LayerSeed), so that both engines draw the same masks.
type dropMask struct {
	layer  int
	p      float32
	buf    []float32
	seed   uint64
	filled bool
}

// fill makes the mask the one of seed.
func (m *dropMask) fill(seed uint64) {
	if m.filled && m.seed == seed {
		return
	}
	ls := LayerSeed(seed, m.layer)
	scale := 1 / (1 - m.p)
	for i := range m.buf {
		if DropoutKeep(ls, uint64(i), m.p) {
			m.buf[i] = scale
		} else {
			m.buf[i] = 0
		}
	}
	m.seed, m.filled = seed, true
}

// erfOp is the error function, elementwise (computed in float64 and rounded): gorgonia
// v0.9.18 has none. Its symbolic derivative is composed from gorgonia's operations.
type erfOp struct{}

func (erfOp) Arity() int { return 1 }

func (erfOp) Type() hm.Type {
	a := hm.TypeVariable('a')
	return hm.NewFnType(a, a)
}

func (erfOp) InferShape(in ...G.DimSizer) (tensor.Shape, error) {
	s, ok := in[0].(tensor.Shape)
	if !ok {
		return nil, fmt.Errorf("erf: input shape of type %T", in[0])
	}
	return s.Clone(), nil
}

func (erfOp) Do(in ...G.Value) (G.Value, error) {
	if len(in) != 1 {
		return nil, fmt.Errorf("erf: %d inputs", len(in))
	}
	switch x := in[0].(type) {
	case *tensor.Dense:
		src, ok := x.Data().([]float32)
		if !ok {
			return nil, fmt.Errorf("erf: input of type %v, want float32", x.Dtype())
		}
		if x.IsView() || !x.IsNativelyAccessible() {
			x = x.Materialize().(*tensor.Dense)
			src = x.Data().([]float32)
		}
		dst := make([]float32, len(src))
		for i, v := range src {
			dst[i] = float32(math.Erf(float64(v)))
		}
		return tensor.New(tensor.WithShape(x.Shape().Clone()...), tensor.WithBacking(dst)), nil
	case *G.F32:
		return G.NewF32(float32(math.Erf(float64(*x)))), nil
	}
	return nil, fmt.Errorf("erf: input of type %T", in[0])
}

func (erfOp) ReturnsPtr() bool      { return false }
func (erfOp) CallsExtern() bool     { return false }
func (erfOp) OverwritesInput() int  { return -1 }
func (erfOp) WriteHash(h hash.Hash) { fmt.Fprint(h, "erf") }
func (o erfOp) Hashcode() uint32    { return 0x6572_6631 } // "erf1"
func (erfOp) String() string        { return "erf" }
func (erfOp) DiffWRT(n int) []bool  { return []bool{true} }

// SymDiff: d erf(u)/du = 2/√π · exp(−u²).
func (erfOp) SymDiff(in G.Nodes, out, grad *G.Node) (G.Nodes, error) {
	u := in[0]
	e, err := G.Exp(G.Must(G.Neg(G.Must(G.Square(u)))))
	if err != nil {
		return nil, err
	}
	d, err := G.Mul(e, scalar(2/math.Sqrt(math.Pi)))
	if err != nil {
		return nil, err
	}
	g, err := G.HadamardProd(grad, d)
	if err != nil {
		return nil, err
	}
	return G.Nodes{g}, nil
}
