//go:build !cuda

package model

import (
	"errors"
	"fmt"
	"sort"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/blas"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// Net is a Spec compiled into gorgonia graphs whose parameters are views of a flat buffer.
type Net struct {
	spec      *Spec
	layout    *Layout
	params    []float32
	grad      half.Format
	micro     int
	train     *graph      // nil when checkpointing
	recompute *recomputed // nil without activation recomputation
	eval      *graph
	// masks are the dropout layers' masks, shared by the training graphs (one micro-batch
	// size) and refilled from dropSeed before each training run.
	masks    map[int]*dropMask
	dropSeed uint64
}

// graph is one compiled gorgonia program at a fixed batch size.
type graph struct {
	bs    int
	g     *G.ExprGraph
	vm    G.VM
	x, y  *G.Node
	scale *G.Node // nil for the evaluation graph
	ce    *G.Node // mean cross-entropy (training graph)
	cost  *G.Node // ce × scale (training graph)
	xbuf  []float32
	ybuf  []float32 // one-hot labels, bs×classes (training graph only)
	learn G.Nodes   // parameter nodes, parallel to tensors
	tidx  []int     // layout index of each learn node
	// byOffset lists indices into learn in increasing flat offset of their tensors.
	byOffset []int
	order    []paramNode // learn in byOffset order, built on first use
	lossV    G.Value     // mean cross-entropy (training graph)
	logitV   G.Value     // logits (evaluation graph)
	// stats are the batch norm layers' batch statistics a training run reads out for the
	// running statistics.
	stats []*bnRead
}

// New compiles spec into a training graph at opt.MicroBatch and an evaluation graph at
// opt.EvalBatch, both viewing params (len layout.Size), which the caller owns and may update
// in place between calls.
func New(spec *Spec, layout *Layout, params []float32, opt Options) (*Net, error) {
	if len(params) != layout.Size {
		return nil, fmt.Errorf("model: params has %d elements, layout needs %d", len(params), layout.Size)
	}
	if opt.MicroBatch < 1 || opt.EvalBatch < 1 {
		return nil, fmt.Errorf("model: micro-batch and eval batch must be >= 1, got %d and %d", opt.MicroBatch, opt.EvalBatch)
	}
	if layout.Trainable() == 0 {
		return nil, errors.New("model: every parameter is frozen: nothing to train")
	}
	blas.Use()
	n := &Net{spec: spec, layout: layout, params: params, grad: opt.Grad, micro: opt.MicroBatch}
	var err error
	if opt.Segments > 1 {
		if n.recompute, err = n.buildRecomputed(opt.MicroBatch, opt.Segments); err != nil {
			return nil, fmt.Errorf("model: building checkpointed training graphs: %w", err)
		}
	} else if n.train, err = n.build(opt.MicroBatch, true); err != nil {
		return nil, fmt.Errorf("model: building training graph: %w", err)
	}
	if n.eval, err = n.build(opt.EvalBatch, false); err != nil {
		n.train.close()
		n.recompute.close()
		return nil, fmt.Errorf("model: building evaluation graph: %w", err)
	}
	return n, nil
}

func (n *Net) build(bs int, train bool) (gr *graph, err error) {
	// gorgonia reports many construction errors by panicking (G.Must and shape checks);
	// turn them into errors so a bad config never crashes the process.
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("gorgonia: %v", r)
		}
	}()
	s := n.spec
	gr = &graph{bs: bs, g: G.NewGraph()}
	in := prod(s.Input)
	gr.xbuf = make([]float32, bs*in)
	xshape := append([]int{bs}, s.Input...)
	if s.Layers[0].Kind == Flatten {
		xshape = []int{bs, in} // an MLP reads rows directly: no reshape op in the graph
	}
	gr.x = G.NewTensor(gr.g, G.Float32, len(xshape), G.WithShape(xshape...), G.WithName("x"),
		G.WithValue(tensor.New(tensor.WithShape(xshape...), tensor.WithBacking(gr.xbuf))))

	param := func(ti int, shape ...int) *G.Node {
		t := n.layout.Tensors[ti]
		v := tensor.New(tensor.WithShape(shape...), tensor.WithBacking(n.params[t.Offset:t.Offset+t.Size]))
		node := G.NewTensor(gr.g, G.Float32, len(shape), G.WithShape(shape...), G.WithName(t.Name), G.WithValue(v))
		if !t.Frozen { // a frozen tensor is a constant of the graph: no gradient is computed for it
			gr.learn = append(gr.learn, node)
			gr.tidx = append(gr.tidx, ti)
		}
		return node
	}

	ctx := &graphCtx{g: gr.g, bs: bs, train: train, stats: train, param: param, mask: n.mask}
	h, err := addLayers(gr.x, ctx, s.Layers)
	if err != nil {
		return nil, err
	}
	gr.stats = ctx.reads

	if !train {
		G.Read(h, &gr.logitV)
		gr.vm = G.NewTapeMachine(gr.g)
		return gr, nil
	}

	gr.ybuf = make([]float32, bs*s.Classes)
	gr.y, gr.scale, gr.ce, gr.cost = addLoss(gr.g, h, gr.ybuf, bs, s.Classes)
	G.Read(gr.ce, &gr.lossV)
	if _, err := G.Grad(gr.cost, gr.learn...); err != nil {
		return nil, fmt.Errorf("symbolic gradient: %w", err)
	}
	gr.vm = G.NewTapeMachine(gr.g, G.BindDualValues(gr.learn...))
	gr.byOffset = n.byOffset(gr.tidx)
	return gr, nil
}

// mask returns dropout layer i's mask buffer for the training graphs (micro-batch size).
func (n *Net) mask(i int) []float32 {
	if m, ok := n.masks[i]; ok {
		return m.buf
	}
	if n.masks == nil {
		n.masks = map[int]*dropMask{}
	}
	l := n.spec.Layers[i]
	m := &dropMask{layer: i, p: l.P, buf: make([]float32, n.micro*prod(l.InShape))}
	n.masks[i] = m
	return m.buf
}

// SetDropoutSeed seeds the dropout masks of the next training passes: layer i's mask is
// DropoutKeep(LayerSeed(seed, i), element, p) over the micro-batch's elements, as on the
// native engine, and a checkpointed segment's recomputation uses the same masks.
func (n *Net) SetDropoutSeed(seed uint64) { n.dropSeed = seed }

// byOffset returns the indices into tidx (layout indices) ordered by increasing flat offset.
func (n *Net) byOffset(tidx []int) []int {
	idx := make([]int, len(tidx))
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool {
		return n.layout.Tensors[tidx[idx[a]]].Offset < n.layout.Tensors[tidx[idx[b]]].Offset
	})
	return idx
}

// addLayers appends layers (Spec.Layers[c.first:][:len(layers)]) to the graph of h (a batch
// of c.bs inputs to layers[0]) and returns the output; c.param makes the node viewing a
// parameter tensor in the flat buffer.
func addLayers(h *G.Node, c *graphCtx, layers []Layer) (*G.Node, error) {
	bs, param := c.bs, c.param
	var skips []*G.Node // the inputs of the open residual branches
	for j, l := range layers {
		switch l.Kind {
		case Dense:
			w := param(l.Weight, l.In, l.Out)
			b := param(l.Bias, 1, l.Out)
			h = reshapeTo(h, bs*l.Rows(), l.In) // a sequence's tokens are rows
			h = G.Must(G.BroadcastAdd(G.Must(G.Mul(h, w)), b, nil, []byte{0}))
		case Conv2D:
			h = reshapeTo(h, append([]int{bs}, l.InShape...)...)
			w := param(l.Weight, l.Out, l.In, l.Kernel, l.Kernel)
			b := param(l.Bias, 1, l.Out, 1, 1)
			h = G.Must(G.Conv2d(h, w, tensor.Shape{l.Kernel, l.Kernel}, []int{l.Pad, l.Pad}, []int{1, 1}, []int{1, 1}))
			h = G.Must(G.BroadcastAdd(h, b, nil, []byte{0, 2, 3}))
		case ReLU:
			h = G.Must(G.Rectify(h))
		case MaxPool2:
			h = reshapeTo(h, append([]int{bs}, l.InShape...)...)
			h = G.Must(G.MaxPool2D(h, tensor.Shape{2, 2}, []int{0, 0}, []int{2, 2}))
		case Flatten:
			if h.Shape().Dims() != 2 {
				h = G.Must(G.Reshape(h, tensor.Shape{bs, prod(l.OutShape)}))
			}
		default:
			var err error
			if h, err = c.addNewLayer(h, c.first+j, l, &skips); err != nil {
				return nil, err
			}
		}
	}
	if len(skips) != 0 {
		return nil, fmt.Errorf("%d residual branches not closed by an add", len(skips))
	}
	return h, nil
}

// addLoss appends the training loss to the graph of the logits h: the mean cross-entropy ce
// against the one-hot labels y (a view of ybuf) and cost = ce × scale.
func addLoss(g *G.ExprGraph, h *G.Node, ybuf []float32, bs, classes int) (y, scale, ce, cost *G.Node) {
	y = G.NewMatrix(g, G.Float32, G.WithShape(bs, classes), G.WithName("y"),
		G.WithValue(tensor.New(tensor.WithShape(bs, classes), tensor.WithBacking(ybuf))))
	scale = G.NewScalar(g, G.Float32, G.WithName("loss_scale"), G.WithValue(float32(1)))
	// Cross-entropy from log-softmax (numerically stable), mean over the micro-batch.
	lsm := G.Must(G.LogSoftMax(h, 1))
	ce = G.Must(G.Neg(G.Must(G.Mean(G.Must(G.Sum(G.Must(G.HadamardProd(lsm, y)), 1))))))
	// The loss scale (fp16 loss scaling, and 1/accum for gradient accumulation) multiplies the
	// loss inside the graph so every backward intermediate is scaled, as on a real fp16 device.
	cost = G.Must(G.Mul(ce, scale))
	return y, scale, ce, cost
}

func (gr *graph) close() {
	if gr != nil && gr.vm != nil {
		gr.vm.Close()
		gr.vm = nil
	}
}

// run executes the graph once and resets the machine for the next run.
func (gr *graph) run() error { return runVM(gr.vm) }

// runVM executes a compiled graph once and resets the machine for the next run; the nodes
// keep the values of the run.
func runVM(vm G.VM) (err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("model: graph execution panicked: %v", r)
		}
	}()
	defer vm.Reset()
	return vm.RunAll()
}

// Spec returns the network's specification.
func (n *Net) Spec() *Spec { return n.spec }

// Layout returns the flat parameter layout.
func (n *Net) Layout() *Layout { return n.layout }

// Params returns the flat parameter buffer the graphs view.
func (n *Net) Params() []float32 { return n.params }

// MicroBatch is the training graph's batch size.
func (n *Net) MicroBatch() int { return n.micro }

// EvalBatch is the evaluation graph's batch size.
func (n *Net) EvalBatch() int { return n.eval.bs }

// ForwardBackward runs one micro-batch (b.N must equal MicroBatch) and hands the gradient of
// loss×scale to sink, tensor by tensor from the top of the flat space, in pieces between the
// sink's cuts: a piece is rounded to the working precision and added to what the sink's
// memory holds (accumulate) or written over it — the semantics of `param.grad +=` on a
// half-precision device. It returns the unscaled mean cross-entropy of the micro-batch.
// gorgonia computes the whole backward pass before any piece goes out, so on this engine the
// reductions overlap nothing; FlatSink(grads) adds the gradient into one full buffer.
func (n *Net) ForwardBackward(b *data.Batch, scale float32, sink GradSink) (float32, error) {
	ext := n.layout.Extents()
	byOff := map[int]Extent{}
	for _, x := range ext {
		byOff[x.Off] = x
	}
	return n.forwardBackward(b, scale, func(off int, g []float32) error {
		x, ok := byOff[off]
		if !ok || x.Size != len(g) {
			return fmt.Errorf("model: no trainable tensor of %d elements at offset %d", len(g), off)
		}
		if n.grad != half.FP32 {
			vec.Round(g, n.grad)
		}
		return x.Pieces(sink.Cuts(), func(lo, hi int) error {
			dst, acc, err := sink.Acquire(lo, hi)
			if err != nil {
				return err
			}
			if acc {
				accumulate(dst, g[lo-off:hi-off], n.grad)
			} else {
				copy(dst, g[lo-off:hi-off])
			}
			return sink.Release(lo, hi)
		})
	})
}

// forwardBackward runs the training graph (or the checkpointed segments) on b and passes each
// parameter's gradient to use, in decreasing flat-offset order (as a backward pass produces
// them), then clears it.
func (n *Net) forwardBackward(b *data.Batch, scale float32, use func(off int, g []float32) error) (float32, error) {
	in := prod(n.spec.Input)
	if b.N != n.micro || b.SampleSize != in {
		return 0, fmt.Errorf("%w: training graph takes %d samples of %d values, got %d of %d", ErrBatch, n.micro, in, b.N, b.SampleSize)
	}
	xbuf, ybuf, order := n.trainBuffers()
	copy(xbuf, b.X[:len(xbuf)])
	clear(ybuf)
	classes := n.spec.Classes
	for i := 0; i < n.micro; i++ {
		y := int(b.Y[i])
		if y < 0 || y >= classes {
			return 0, fmt.Errorf("%w: label %d of sample %d outside [0, %d)", ErrBatch, y, i, classes)
		}
		ybuf[i*classes+y] = 1
	}
	for _, m := range n.masks {
		m.fill(n.dropSeed)
	}
	var loss float32
	var err error
	if n.recompute != nil {
		loss, err = n.recompute.forwardBackward(scale, n.updateRunning)
	} else if loss, err = n.train.forwardBackward(scale); err == nil {
		err = n.updateRunning(n.train.stats)
	}
	if err != nil {
		return 0, err
	}
	for k := len(order) - 1; k >= 0; k-- {
		p := order[k]
		gv, err := p.node.Grad()
		if err != nil {
			return 0, fmt.Errorf("model: reading gradient of %s: %w", p.node.Name(), err)
		}
		src, ok := gv.Data().([]float32)
		t := n.layout.Tensors[p.tensor]
		if !ok || len(src) != t.Size {
			return 0, fmt.Errorf("model: gradient of %s has unexpected type or size", t.Name)
		}
		if err := use(t.Offset-n.layout.Frozen, src); err != nil {
			return 0, err
		}
		// gorgonia's tape machine adds each run's gradient into the node's dual value (its
		// solvers zero it after every step); zero it so each call sees one micro-batch only.
		clear(src)
	}
	return loss, nil
}

// updateRunning updates the batch norm layers' running statistics in the flat buffer from a
// training run's batch statistics.
func (n *Net) updateRunning(reads []*bnRead) error {
	return updateRunning(n.spec, n.layout, n.params, reads)
}

// paramNode is a parameter node of a training graph and the layout index of its tensor.
type paramNode struct {
	node   *G.Node
	tensor int
}

// trainBuffers returns the training input and one-hot label buffers and the parameter nodes
// in increasing flat offset.
func (n *Net) trainBuffers() (x, y []float32, order []paramNode) {
	if n.recompute != nil {
		return n.recompute.segs[0].in, n.recompute.ybuf, n.recompute.order
	}
	gr := n.train
	if gr.order == nil {
		for _, i := range gr.byOffset {
			gr.order = append(gr.order, paramNode{gr.learn[i], gr.tidx[i]})
		}
	}
	return gr.xbuf, gr.ybuf, gr.order
}

// forwardBackward runs the whole training graph once and returns the unscaled loss.
func (gr *graph) forwardBackward(scale float32) (float32, error) {
	if err := G.Let(gr.scale, scale); err != nil {
		return 0, fmt.Errorf("model: setting loss scale: %w", err)
	}
	if err := gr.run(); err != nil {
		return 0, fmt.Errorf("model: forward/backward: %w", err)
	}
	if testHookAfterRun != nil {
		testHookAfterRun()
	}
	loss, ok := gr.lossV.Data().(float32)
	if !ok {
		return 0, fmt.Errorf("model: loss has type %T, want float32", gr.lossV.Data())
	}
	return loss, nil
}

// testHookAfterRun, when set by a test, is called after every training-graph run while the
// run's values are still bound: the point of peak live activation memory.
var testHookAfterRun func()

// accumulate adds src into dst in working precision f.
func accumulate(dst, src []float32, f half.Format) {
	src = src[:len(dst)]
	if f == half.FP32 {
		for i, g := range src {
			dst[i] += g
		}
		return
	}
	vec.Round(src, f)
	for i, g := range src {
		dst[i] += g
	}
	vec.Round(dst, f)
}

// Evaluate runs the forward graph on the first b.N rows of b (b.N <= EvalBatch; padding rows
// are computed but ignored) and sums their loss and correct predictions.
func (n *Net) Evaluate(b *data.Batch) (EvalResult, error) {
	gr := n.eval
	if b.N < 0 || b.N > gr.bs || b.SampleSize != prod(n.spec.Input) {
		return EvalResult{}, fmt.Errorf("%w: evaluation graph takes up to %d samples of %d values, got %d of %d", ErrBatch, gr.bs, prod(n.spec.Input), b.N, b.SampleSize)
	}
	copy(gr.xbuf, b.X[:b.N*b.SampleSize])
	clear(gr.xbuf[b.N*b.SampleSize:])
	if err := gr.run(); err != nil {
		return EvalResult{}, fmt.Errorf("model: evaluation forward: %w", err)
	}
	logits, ok := gr.logitV.Data().([]float32)
	classes := n.spec.Classes
	if !ok || len(logits) != gr.bs*classes {
		return EvalResult{}, fmt.Errorf("model: logits have unexpected type or size")
	}
	return Score(logits, b.Y, b.N, classes)
}

// Close releases the graphs' machines; safe to call twice.
func (n *Net) Close() error {
	n.train.close()
	n.recompute.close()
	n.eval.close()
	return nil
}
