//go:build !cuda

package model

import (
	"fmt"
	"sync"

	G "gorgonia.org/gorgonia"
	"gorgonia.org/tensor"
)

// Activation checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
// PyTorch's checkpoint_sequential). The layers are split into K contiguous segments, each
// compiled as its own gorgonia graph at the micro-batch size. The forward pass runs segments
// 0..K-2 through forward-only graphs and keeps only each segment's input (the previous
// segment's output, copied into a buffer the Net owns); the last segment runs forward, loss and
// backward at once. Then, from segment K-2 down to 0, a segment's backward graph recomputes its
// forward from the saved input and back-propagates the upstream gradient g_up (the gradient of
// loss×scale with respect to the segment's output): a vector-Jacobian product, the gradient of
// ⟨output, g_up⟩ with the seed g_up handed to gorgonia's Backpropagate directly, which gives the
// parameter gradients and the gradient with respect to the segment input — the next g_up.
//
// The segment graphs hold the same operations as the single training graph and their
// backward starts from the very same upstream values, so the gradients are bit for bit those
// of the plain run (net_test.go checks this).
//
// gorgonia binds every node's value to the node after a run and keeps it until the next run
// replaces it, so a graph holds all its activations between calls. After each segment run the
// segment's non-input values are unbound, leaving them to the garbage collector: the live
// activation memory of a step is the saved segment inputs plus one segment's values, instead
// of all values of the whole network.

// segment is a contiguous run of layers, starting at one of CutPoints (outside every
// residual branch, so that a branch's input and its Add are in the same graph).
type segment struct {
	layers  []Layer   // a view of Spec.Layers
	first   int       // the index of layers[0] in Spec.Layers
	inShape []int     // the input's shape, batch first
	in      []float32 // saved input: the images for segment 0, the previous output otherwise
	gup     []float32 // upstream gradient of loss×scale w.r.t. the output (not the last segment)
	fwd     *segGraph // forward only (not the last segment)
	bwd     *segGraph // recomputed forward and backward (for the last: forward, loss, backward)
}

// segGraph is one compiled segment graph.
type segGraph struct {
	g   *G.ExprGraph
	vm  G.VM
	out *G.Node // the segment output (logits for the last segment)
	// inGrad is the gradient w.r.t. the segment input; nil for forward graphs and where no
	// segment below holds a trainable tensor (segment 0 always).
	inGrad *G.Node
	stats  []*bnRead // batch norm statistics the run reads (the forward graphs and the last segment's)
	learn  G.Nodes
	tidx   []int
	scale  *G.Node // last segment's backward graph only
	ce     *G.Node // last segment's backward graph only
}

// recomputed is the training side of a Net with activation recomputation.
type recomputed struct {
	segs []segment
	ybuf []float32 // one-hot labels, read by the last segment
	// below[i]: some segment before i holds a trainable tensor, so segment i's backward
	// pass must produce the gradient with respect to its input.
	below []bool
	own   []bool      // own[i]: segment i holds a trainable tensor
	order []paramNode // parameter nodes of the backward graphs in increasing flat offset
}

// poolOnce turns the tensor package's *Dense pool off, once per process. Unbinding a node
// returns its value to that pool, and gorgonia binds one *Dense to several nodes (in-place
// ops, reads), so the pool would later hand the same tensor to two new owners. The pool only
// recycles tensor headers, not their data; without it every value is an ordinary allocation.
var poolOnce sync.Once

func (n *Net) buildRecomputed(bs, k int) (*recomputed, error) {
	first, err := Segments(n.spec, k)
	if err != nil {
		return nil, err
	}
	poolOnce.Do(tensor.DontUsePool)
	s := &recomputed{segs: make([]segment, k), ybuf: make([]float32, bs*n.spec.Classes), below: make([]bool, k), own: make([]bool, k)}
	ok := false
	defer func() {
		if !ok {
			s.close()
		}
	}()
	layers := n.spec.Layers
	for i := range s.segs {
		sg := &s.segs[i]
		end := len(layers)
		if i+1 < k {
			end = first[i+1]
		}
		sg.layers, sg.first = layers[first[i]:end], first[i]
		if i == 0 {
			sg.inShape = append([]int{bs}, n.spec.Input...)
			if layers[0].Kind == Flatten {
				sg.inShape = []int{bs, prod(n.spec.Input)} // as in the single graph: no reshape op
			}
		} else {
			sg.inShape = append([]int{bs}, sg.layers[0].InShape...)
		}
		sg.in = make([]float32, prod(sg.inShape))
	}
	for i := range s.segs {
		s.own[i] = n.hasTrainable(s.segs[i].layers)
		if i > 0 {
			s.below[i] = s.below[i-1] || s.own[i-1]
		}
	}
	for i := range s.segs {
		sg := &s.segs[i]
		last := i == k-1
		if !last {
			sg.gup = make([]float32, len(s.segs[i+1].in))
			if sg.fwd, err = n.buildSegGraph(s, i, false); err != nil {
				return nil, fmt.Errorf("segment %d forward: %w", i, err)
			}
		}
		if !last && !s.trains(i) {
			continue // no trainable tensor in this segment or below: no backward pass
		}
		if sg.bwd, err = n.buildSegGraph(s, i, true); err != nil {
			return nil, fmt.Errorf("segment %d backward: %w", i, err)
		}
		for j, node := range sg.bwd.learn {
			s.order = append(s.order, paramNode{node, sg.bwd.tidx[j]})
		}
	}
	// Segments are contiguous runs of layers and the layout is in layer order, so segment
	// order is offset order; sort within each anyway, as the single graph does.
	tidx := make([]int, len(s.order))
	for i, p := range s.order {
		tidx[i] = p.tensor
	}
	sorted := make([]paramNode, len(s.order))
	for i, j := range n.byOffset(tidx) {
		sorted[i] = s.order[j]
	}
	s.order = sorted
	ok = true
	return s, nil
}

// trains reports whether segment i or one below it holds a trainable tensor.
func (s *recomputed) trains(i int) bool { return s.own[i] || s.below[i] }

// hasTrainable reports whether any of layers holds a trainable tensor.
func (n *Net) hasTrainable(layers []Layer) bool {
	for _, l := range layers {
		for _, ti := range []int{l.Weight, l.Bias} {
			if ti >= 0 && !n.layout.Tensors[ti].Frozen {
				return true
			}
		}
	}
	return false
}

// buildSegGraph compiles segment i of s: forward only, or forward and backward.
func (n *Net) buildSegGraph(s *recomputed, i int, backward bool) (sg *segGraph, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("gorgonia: %v", r)
		}
	}()
	seg := &s.segs[i]
	bs := seg.inShape[0]
	sg = &segGraph{g: G.NewGraph()}
	in := G.NewTensor(sg.g, G.Float32, len(seg.inShape), G.WithShape(seg.inShape...), G.WithName(fmt.Sprintf("segment%d_in", i)),
		G.WithValue(tensor.New(tensor.WithShape(seg.inShape...), tensor.WithBacking(seg.in))))
	param := func(ti int, shape ...int) *G.Node {
		t := n.layout.Tensors[ti]
		v := tensor.New(tensor.WithShape(shape...), tensor.WithBacking(n.params[t.Offset:t.Offset+t.Size]))
		node := G.NewTensor(sg.g, G.Float32, len(shape), G.WithShape(shape...), G.WithName(t.Name), G.WithValue(v))
		if !t.Frozen { // a frozen tensor is a constant of the graph, as in the single graph
			sg.learn = append(sg.learn, node)
			sg.tidx = append(sg.tidx, ti)
		}
		return node
	}
	last := i == len(s.segs)-1
	// The running statistics are updated once per step: by the forward graphs and the last
	// segment's, not by the recomputations.
	ctx := &graphCtx{g: sg.g, bs: bs, first: seg.first, train: true, stats: !backward || last, param: param, mask: n.mask}
	if sg.out, err = addLayers(in, ctx, seg.layers); err != nil {
		return nil, err
	}
	sg.stats = ctx.reads
	if !backward {
		sg.vm = G.NewTapeMachine(sg.g)
		return sg, nil
	}
	wrt := append(G.Nodes(nil), sg.learn...)
	if s.below[i] {
		wrt = append(wrt, in)
	}
	var grads G.Nodes
	if last {
		var cost *G.Node
		_, sg.scale, sg.ce, cost = addLoss(sg.g, sg.out, s.ybuf, bs, n.spec.Classes)
		grads, err = G.Grad(cost, wrt...)
	} else {
		shape := sg.out.Shape()
		gup := G.NewTensor(sg.g, G.Float32, shape.Dims(), G.WithShape(shape...), G.WithName(fmt.Sprintf("segment%d_grad_out", i)),
			G.WithValue(tensor.New(tensor.WithShape(shape...), tensor.WithBacking(seg.gup))))
		grads, err = G.Backpropagate(G.Nodes{sg.out}, G.Nodes{gup}, wrt)
	}
	if err != nil {
		return nil, fmt.Errorf("symbolic gradient: %w", err)
	}
	if s.below[i] {
		sg.inGrad = grads[len(grads)-1]
	}
	sg.vm = G.NewTapeMachine(sg.g, G.BindDualValues(sg.learn...))
	return sg, nil
}

// run executes the segment graph once; release must follow once its values have been read.
func (sg *segGraph) run() error {
	if err := runVM(sg.vm); err != nil {
		return err
	}
	if testHookAfterRun != nil {
		testHookAfterRun()
	}
	return nil
}

// release drops the values of the last run (all but the inputs: parameter views, the saved
// input, the upstream gradient and the parameter gradients), so the segment's activations
// are garbage once the caller has copied out what it needs.
func (sg *segGraph) release() { sg.g.UnbindAllNonInputs() }

// copyOut copies the value of node into dst.
func copyOut(dst []float32, node *G.Node) error {
	v := node.Value()
	if v == nil {
		return fmt.Errorf("%s has no value", node.Name())
	}
	src, ok := v.Data().([]float32)
	if !ok || len(src) != len(dst) {
		return fmt.Errorf("%s: value of type %T, want %d float32", node.Name(), v.Data(), len(dst))
	}
	copy(dst, src)
	return nil
}

// forwardBackward runs the checkpointed step; segs[0].in and ybuf hold the batch. The
// parameter gradients are left in the backward graphs' dual values.
func (s *recomputed) forwardBackward(scale float32, update func([]*bnRead) error) (float32, error) {
	k := len(s.segs)
	for i := 0; i < k-1; i++ {
		fwd := s.segs[i].fwd
		if err := fwd.run(); err != nil {
			return 0, fmt.Errorf("model: segment %d forward: %w", i, err)
		}
		err := copyOut(s.segs[i+1].in, fwd.out)
		if err == nil {
			err = update(fwd.stats)
		}
		fwd.release()
		if err != nil {
			return 0, fmt.Errorf("model: segment %d output: %w", i, err)
		}
	}
	var loss float32
	for i := k - 1; i >= 0; i-- {
		bwd := s.segs[i].bwd
		if bwd == nil {
			break // nothing trainable from here down
		}
		if i == k-1 {
			if err := G.Let(bwd.scale, scale); err != nil {
				return 0, fmt.Errorf("model: setting loss scale: %w", err)
			}
		}
		if err := bwd.run(); err != nil {
			return 0, fmt.Errorf("model: segment %d forward/backward: %w", i, err)
		}
		var err error
		if i == k-1 {
			l, ok := bwd.ce.Value().Data().(float32)
			if !ok {
				err = fmt.Errorf("loss has type %T, want float32", bwd.ce.Value().Data())
			}
			loss = l
			if err == nil {
				err = update(bwd.stats)
			}
		}
		if err == nil && bwd.inGrad != nil {
			err = copyOut(s.segs[i-1].gup, bwd.inGrad)
		}
		bwd.release()
		if err != nil {
			return 0, fmt.Errorf("model: segment %d: %w", i, err)
		}
	}
	return loss, nil
}

// close releases the segment graphs' machines; safe on nil and twice.
func (s *recomputed) close() {
	if s == nil {
		return
	}
	for i := range s.segs {
		for _, sg := range []*segGraph{s.segs[i].fwd, s.segs[i].bwd} {
			if sg != nil && sg.vm != nil {
				sg.vm.Close()
				sg.vm = nil
			}
		}
	}
}
