package engine

import (
	"errors"
	"fmt"
	"math"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
	"github.com/qvd/qvd/model"
)

// Options sizes a Net.
type Options struct {
	MicroBatch int         // samples per ForwardBackward
	EvalBatch  int         // most samples per Evaluate
	Precision  half.Format // the type of weights, activations and gradients on the device
	// Segments > 1 turns on activation checkpointing (model.activation_checkpointing): the
	// layers are cut where model.Segments cuts them for the CPU engine, only each segment's
	// input is kept through the forward pass, and the backward pass recomputes one segment's
	// activations at a time.
	Segments int
}

// Net runs a model.Spec on a Device, layer by layer as GEMMs and kernels on device buffers.
// Weights live in one flat device buffer with the model's layout (tensors are views by
// offset), in the working precision. Activations are allocated per call from the caching
// Allocator, so an out-of-memory micro-batch fails cleanly (memory.ErrOutOfMemory) before the
// first gradient is written, and the next one reuses the cached blocks.
//
// The gradient goes to a model.GradSink (the trainer's ZeRO engine) piece by piece:
//
//   - On a device whose memory is the host's (the CPU backend, a HostMemory), each piece is
//     computed straight into the sink's memory as the backward pass reaches it — a Linear
//     weight's gradient a block of rows at a time, cut where the sink's buckets are — so the
//     sink reduces a bucket while the pass goes on below, and in fp32 the weights the trainer
//     updates are the ones the device computes with: there are no copies at all.
//   - On a GPU the pass computes the gradient into one flat device buffer; each tensor's part
//     starts for the host on the copy stream as soon as its kernels are queued, and the pieces
//     go to the sink after the pass. Without offload at stage 0 the trainer can keep the
//     gradient and the optimizer on the device instead (devstep.go).
//
// Net implements the trainer's Model interface.
type Net struct {
	dev    Device
	hostm  HostMemory // dev's host-memory view, nil for a GPU
	alloc  *Allocator
	spec   *model.Spec
	layout *model.Layout
	extent []model.Extent // the trainable tensors (Layout.Extents), by tensor index
	dt     DType
	micro  int
	evalBS int

	host   []float32 // Params(): the working weights the trainer writes (fp32 values, rounded)
	params Buf       // the device copy, in dt (a view of host on a HostMemory device in fp32)
	viewed bool      // params is a view of host
	grads  Buf       // GPU: the trainable suffix's gradient, in dt
	gbuf   []float32 // GPU: host staging for grads
	// needDx[i]: the backward pass must compute layer i's input gradient (some trainable
	// parameter lies below it).
	needDx []bool
	segs   []int // first layer of each checkpointed segment; nil without checkpointing
	syncs  int64
	adam   *Adam // the device optimizer (EnableDeviceOptimizer), nil with offload
	// onGrad, if set, is called once a trainable tensor's gradient (its view and its offset in
	// the trainable part) has been queued by the backward pass.
	onGrad func(g Buf, off int)
	sink   model.GradSink // the host-memory pass's destination (ForwardBackward), nil otherwise
	wrote  bool           // a piece went to sink in this pass
	// waiter is sink as a model.ParamWaiter in a pass that reads the parameters in place;
	// paramEnd[i] is the end (trainable offset) of the trainable tensors of layers 0..i.
	waiter   model.ParamWaiter
	paramEnd []int
	// dropSeed seeds the next training pass's dropout masks (SetDropoutSeed).
	dropSeed uint64
	onesN    int // the longest vector of ones mean pooling needs
}

// SetDropoutSeed seeds the dropout masks of the next training passes. The trainer derives
// it from the run's seed, the step, the micro-batch and the rank, so a resumed run draws the
// masks it would have drawn, and each rank draws its own (as each DDP process has its own
// generator). The checkpointed backward pass recomputes a segment with the same masks.
func (n *Net) SetDropoutSeed(seed uint64) { n.dropSeed = seed }

// layerSeed is layer i's dropout seed in this pass.
func (n *Net) layerSeed(i int) uint64 { return model.LayerSeed(n.dropSeed, i) }

// HostMemory is a Device whose memory is the host's (the CPU backend): View makes a slice of
// host memory a device buffer without a copy, Unview ends it.
type HostMemory interface {
	View(x []float32) Buf
	Unview(b Buf)
}

// NewNet places spec's parameters (params, len layout.Size, which the caller owns and
// updates between calls) on the allocator's device.
func NewNet(alloc *Allocator, spec *model.Spec, layout *model.Layout, params []float32, opt Options) (*Net, error) {
	if len(params) != layout.Size {
		return nil, fmt.Errorf("engine: params has %d elements, layout needs %d", len(params), layout.Size)
	}
	if opt.MicroBatch < 1 || opt.EvalBatch < 1 {
		return nil, fmt.Errorf("engine: micro-batch and eval batch must be >= 1, got %d and %d", opt.MicroBatch, opt.EvalBatch)
	}
	if layout.Trainable() == 0 {
		return nil, errors.New("engine: every parameter is frozen: nothing to train")
	}
	n := &Net{dev: alloc.Device(), alloc: alloc, spec: spec, layout: layout, dt: FromFormat(opt.Precision),
		micro: opt.MicroBatch, evalBS: opt.EvalBatch, host: params}
	n.hostm, _ = n.dev.(HostMemory)
	for _, l := range spec.Layers {
		if l.Kind == model.Conv2D && l.Kernel > l.InShape[1]+2*l.Pad {
			return nil, fmt.Errorf("engine: layer %s: kernel %d larger than its padded input", l.Name, l.Kernel)
		}
	}
	n.extent = make([]model.Extent, len(layout.Tensors))
	n.paramEnd = make([]int, len(spec.Layers))
	ei := 0
	exts := layout.Extents()
	for i, t := range layout.Tensors {
		if !t.Frozen {
			n.extent[i] = exts[ei]
			ei++
			if t.Layer >= 0 && t.Layer < len(n.paramEnd) {
				n.paramEnd[t.Layer] = max(n.paramEnd[t.Layer], n.extent[i].Off+n.extent[i].Size)
			}
		}
	}
	for i := 1; i < len(n.paramEnd); i++ {
		n.paramEnd[i] = max(n.paramEnd[i], n.paramEnd[i-1])
	}
	if opt.Segments > 1 {
		segs, err := model.Segments(spec, opt.Segments)
		if err != nil {
			return nil, fmt.Errorf("engine: %w", err)
		}
		n.segs = segs
	}
	for _, l := range spec.Layers {
		if l.Kind == model.MeanPool {
			n.onesN = max(n.onesN, prod(l.InShape)/l.OutShape[0])
		}
	}
	n.needDx = make([]bool, len(spec.Layers))
	below := false
	for i, l := range spec.Layers {
		n.needDx[i] = below
		for _, ti := range []int{l.Weight, l.Bias} {
			if ti >= 0 && !layout.Tensors[ti].Frozen {
				below = true
			}
		}
	}
	if n.hostm != nil && n.dt == F32 {
		n.params, n.viewed = n.hostm.View(params), true
	} else {
		var err error
		if n.params, err = alloc.Alloc(layout.Size, n.dt); err != nil {
			return nil, fmt.Errorf("engine: placing the parameters: %w", err)
		}
	}
	if n.hostm == nil {
		var err error
		if n.grads, err = alloc.Alloc(layout.Trainable(), n.dt); err != nil {
			n.Close()
			return nil, fmt.Errorf("engine: placing the gradient buffer: %w", err)
		}
		n.dev.Fill(n.grads, 0) // alignment padding stays zero: no kernel writes it
		n.gbuf = make([]float32, layout.Trainable())
	}
	if err := n.SyncParams(); err != nil {
		n.Close()
		return nil, err
	}
	return n, nil
}

// Spec returns the network's specification.
func (n *Net) Spec() *model.Spec { return n.spec }

// Layout returns the flat parameter layout.
func (n *Net) Layout() *model.Layout { return n.layout }

// Params is the host copy of the working weights: the trainer writes the optimizer's result
// here and calls SyncParams.
func (n *Net) Params() []float32 { return n.host }

// MicroBatch is the training batch size.
func (n *Net) MicroBatch() int { return n.micro }

// EvalBatch is the largest evaluation batch.
func (n *Net) EvalBatch() int { return n.evalBS }

// Allocator returns the device allocator (its Stats are the engine's device memory).
func (n *Net) Allocator() *Allocator { return n.alloc }

// SyncParams copies the host working weights to the device (host → device, in the working
// precision). The trainer calls it after every write to Params. With the device optimizer the
// device's weights are the ones that are current and it does nothing (PushState loads them).
func (n *Net) SyncParams() error {
	if n.adam != nil || n.viewed {
		return nil // the device's weights are the current ones (or are the host's)
	}
	n.syncs++
	if a, ok := n.dev.(AsyncUploader); ok {
		// On the copy stream: the host goes on to fill the next micro-batch while the weights
		// travel, and the forward pass's kernels wait for them on the device. A failure is
		// latched and reported by the step's first Download.
		a.UploadAsync(n.params, n.host)
		a.WaitUploads()
		return nil
	}
	n.dev.Upload(n.params, n.host)
	if err := n.dev.Sync(); err != nil {
		return fmt.Errorf("engine: copying the parameters to the device: %w", err)
	}
	return nil
}

// ReadsParamsInPlace says the device computes on the host's working weights themselves (a
// host-memory device in fp32), so a training pass can wait for each layer's parameters as it
// reaches them (model.LazyParams).
func (n *Net) ReadsParamsInPlace() bool { return n.viewed && n.adam == nil }

// AsyncUploader is a Device with a copy stream (the CUDA backend): UploadAsync converts src
// into staging memory before it returns (src may then change) and copies it on the copy
// stream; WaitUploads makes the compute stream wait for those copies, on the device.
type AsyncUploader interface {
	UploadAsync(dst Buf, src []float32)
	WaitUploads()
}

// AsyncDownloader is a Device that copies to the host on its copy stream (the CUDA backend):
// DownloadAsync queues a copy of src that starts after the compute work queued so far, and
// WaitDownloads waits for the copies, converts them into their destinations and returns the
// first error since the last Sync.
type AsyncDownloader interface {
	DownloadAsync(dst []float32, src Buf)
	WaitDownloads() error
}

// DeviceMemory reports the allocator's figures for the memory monitor and metrics.
func (n *Net) DeviceMemory() map[string]int64 {
	s := n.alloc.Stats()
	return map[string]int64{"qvd_allocated": s.Allocated, "qvd_reserved": s.Reserved,
		"qvd_max_allocated": s.MaxAllocated, "qvd_max_reserved": s.MaxReserved}
}

// Close frees the device buffers (not the allocator or device, which the caller owns).
func (n *Net) Close() error {
	if n.adam != nil {
		n.adam.Close()
		n.adam = nil
	}
	if n.viewed {
		n.hostm.Unview(n.params)
	} else {
		n.alloc.Free(n.params)
	}
	n.alloc.Free(n.grads)
	n.params, n.grads, n.viewed = Buf{}, Buf{}, false
	return nil
}

// ErrBatch reports a batch that does not fit the net.
var ErrBatch = model.ErrBatch

// ForwardBackward runs one micro-batch and hands the gradient of loss×scale, in the working
// precision, to sink piece by piece (see Net). It returns the unscaled mean cross-entropy.
func (n *Net) ForwardBackward(b *data.Batch, scale float32, sink model.GradSink) (float32, error) {
	if n.hostm != nil {
		n.sink, n.wrote = sink, false
		if w, ok := sink.(model.ParamWaiter); ok && n.ReadsParamsInPlace() {
			n.waiter = w
		}
		defer func() { n.sink, n.waiter = nil, nil }()
		return n.run(b, scale, 0)
	}
	loss, err := n.step(b, scale)
	if err != nil {
		return 0, err
	}
	// The pass left the gradient in gbuf: hand it over from the top, as a backward pass would.
	f := n.dt.Format()
	for i := len(n.layout.Tensors) - 1; i >= 0; i-- {
		if n.layout.Tensors[i].Frozen {
			continue
		}
		err := n.extent[i].Pieces(sink.Cuts(), func(lo, hi int) error {
			dst, acc, err := sink.Acquire(lo, hi)
			if err != nil {
				return err
			}
			if acc {
				vec.Add(dst, n.gbuf[lo:hi])
				if f != half.FP32 {
					vec.Round(dst, f)
				}
			} else {
				copy(dst, n.gbuf[lo:hi])
			}
			return sink.Release(lo, hi)
		})
		if err != nil {
			return 0, err
		}
	}
	return loss, nil
}

// grad produces the gradient of trainable tensor ti: compute(g, beta, lo, hi) writes elements
// [lo, hi) of the tensor's gradient (offsets within the tensor; whole rows) into g as
// beta × g + the pass's gradient. On a host-memory device with a sink, each piece the sink's
// cuts make is computed straight into the sink's memory, from the top; otherwise the whole
// tensor goes into the device gradient buffer with the pass's beta.
func (n *Net) grad(ti int, beta float32, compute func(g Buf, beta float32, lo, hi int)) error {
	if n.sink == nil {
		g, _ := n.gradOf(ti)
		compute(g, beta, 0, g.N)
		n.gradDone(ti, g)
		return nil
	}
	x := n.extent[ti]
	return x.Pieces(n.sink.Cuts(), func(lo, hi int) error {
		p, err := n.acquire(lo, hi)
		if err != nil {
			return err
		}
		compute(p.g, p.beta, lo-x.Off, hi-x.Off)
		return n.release(p)
	})
}

// piece is a part of the gradient the sink lent the pass.
type piece struct {
	lo, hi int
	mem    []float32 // the sink's memory
	g      Buf       // mem as a device buffer
	beta   float32   // 1: add to what mem holds; 0: overwrite
}

// acquire takes the sink's memory for [lo, hi) as a device buffer.
func (n *Net) acquire(lo, hi int) (piece, error) {
	dst, acc, err := n.sink.Acquire(lo, hi)
	if err != nil {
		return piece{}, err
	}
	n.wrote = true
	p := piece{lo: lo, hi: hi, mem: dst, g: n.hostm.View(dst)}
	if acc {
		p.beta = 1
	}
	return p, nil
}

// release rounds a written piece to the working precision (the device computed it in fp32
// into fp32 memory) and gives it back to the sink.
func (n *Net) release(p piece) error {
	n.hostm.Unview(p.g)
	if err := n.dev.Sync(); err != nil {
		return fmt.Errorf("engine: backward: %w", err)
	}
	if f := n.dt.Format(); f != half.FP32 {
		vec.Round(p.mem, f)
	}
	return n.sink.Release(p.lo, p.hi)
}

// pass holds one call's device buffers; free returns them all to the allocator.
type pass struct {
	n    *Net
	bufs []Buf
	err  error
	// train: a training pass (dropout draws masks, batch norm uses and updates the batch's
	// statistics); recompute: a checkpointed segment's second forward (the running
	// statistics are not updated twice).
	train, recompute bool
	ones             Buf // a vector of ones (pooling's sums), grown on demand
}

// onesOf returns a view of at least n ones.
func (p *pass) onesOf(n int) Buf {
	if p.ones.N < n && p.err == nil {
		p.ones = p.alloc(n, p.n.dt)
		if p.err == nil {
			p.n.dev.Fill(p.ones, 1)
		}
	}
	if p.err != nil {
		return Buf{}
	}
	return p.ones.Slice(0, n)
}

// fail records err (the first one wins).
func (p *pass) fail(err error) {
	if err != nil && p.err == nil {
		p.err = err
	}
}

func (p *pass) alloc(elems int, t DType) Buf {
	if p.err != nil {
		return Buf{}
	}
	b, err := p.n.alloc.Alloc(elems, t)
	if err != nil {
		p.err = err
		return Buf{}
	}
	p.bufs = append(p.bufs, b)
	return b
}

// release frees the buffers allocated since mark, except keep (which stay held by the pass).
func (p *pass) release(mark int, keep ...Buf) {
	keep = append(keep, p.ones) // shared by every layer that pools
	kept := p.bufs[:mark]
	for _, b := range p.bufs[mark:] {
		held := false
		for _, k := range keep {
			held = held || (k.Ptr == b.Ptr && b.Valid())
		}
		if held {
			kept = append(kept, b)
		} else {
			p.n.alloc.Free(b)
		}
	}
	p.bufs = kept
}

func (p *pass) free() {
	for _, b := range p.bufs {
		p.n.alloc.Free(b)
	}
	p.bufs = nil
}

// layerState is what the backward pass needs of one layer's forward.
type layerState struct {
	in, out Buf // activations (out may alias in: ReLU runs in place)
	idx     Buf // MaxPool2: the argmax indices
	// LayerNorm, BatchNorm2d: the rows' (channels') mean and rstd; Attention: the attention
	// probabilities in aux (N·heads·T·T); PatchEmbed: the patches in aux.
	aux, aux2 Buf
}

// step runs forward and backward on b and leaves the gradient in n.gbuf. On a device with a
// copy stream each layer's gradient starts for the host as soon as its kernels are queued,
// so the copies overlap the backward pass of the layers below.
func (n *Net) step(b *data.Batch, scale float32) (float32, error) {
	if a, ok := n.dev.(AsyncDownloader); ok {
		n.onGrad = func(g Buf, off int) { a.DownloadAsync(n.gbuf[off:off+g.N], g) }
		loss, err := n.run(b, scale, 0)
		n.onGrad = nil
		if werr := a.WaitDownloads(); err == nil && werr != nil {
			err = fmt.Errorf("engine: copying the gradient to the host: %w", werr)
		}
		return loss, err
	}
	loss, err := n.run(b, scale, 0)
	if err != nil {
		return 0, err
	}
	if err := n.dev.Download(n.gbuf, n.grads); err != nil {
		return 0, fmt.Errorf("engine: copying the gradient to the host: %w", err)
	}
	return loss, nil
}

// run runs forward and backward on b, setting the device gradient to beta × itself plus the
// micro-batch's gradient of loss × scale (beta 0: overwrite; 1: accumulate), and returns the
// mean loss.
func (n *Net) run(b *data.Batch, scale, beta float32) (float32, error) {
	in := prod(n.spec.Input)
	if b.N != n.micro || b.SampleSize != in {
		return 0, fmt.Errorf("%w: training takes %d samples of %d values, got %d of %d", ErrBatch, n.micro, in, b.N, b.SampleSize)
	}
	p := &pass{n: n, train: true}
	defer p.free()
	labels, err := n.labels(p, b)
	if err != nil {
		return 0, err
	}
	rows, classes := b.N, n.spec.Classes
	loss := p.alloc(rows, F32)
	if p.err != nil {
		return 0, fmt.Errorf("engine: forward: %w", p.err)
	}
	if n.segs != nil {
		if err := n.runSegments(p, b, labels, loss, scale, beta); err != nil {
			return 0, err
		}
	} else {
		st, logits := n.forward(p, b, b.N)
		if p.err != nil {
			return 0, fmt.Errorf("engine: forward: %w", p.err)
		}
		// d(mean CE × scale)/dlogits, written over the logits (no longer needed).
		n.dev.SoftmaxXent(logits, loss, logits, labels, rows, classes, scale/float32(rows))
		n.backward(p, st, logits, rows, beta)
		if p.err != nil {
			return 0, fmt.Errorf("engine: backward: %w", p.err)
		}
	}
	lossv := make([]float32, rows)
	if err := n.dev.Download(lossv, loss); err != nil {
		return 0, fmt.Errorf("engine: forward/backward: %w", err)
	}
	var sum float64
	for _, v := range lossv {
		sum += float64(v)
	}
	return float32(sum / float64(rows)), nil
}

// ErrGradientLost is returned when a checkpointed backward pass runs out of memory after it
// has added part of a micro-batch's gradient into an accumulating gradient or handed it to the
// sink: the step's gradient cannot be trusted, so the run stops rather than skip the
// micro-batch silently.
var ErrGradientLost = errors.New("engine: out of memory in the middle of a checkpointed backward pass after part of the gradient was written: the step's gradient is lost (lower train.micro_batch, or use fewer segments)")

// runSegments is forward and backward with activation checkpointing: the forward pass keeps
// only each segment's input, and the backward pass recomputes one segment's activations at a
// time from it (the CPU engine's scheme, model/recompute.go). The recomputed operations are
// the same, so the gradient is the plain run's, bit for bit.
func (n *Net) runSegments(p *pass, b *data.Batch, labels, loss Buf, scale, beta float32) error {
	rows, k := b.N, len(n.segs)
	end := func(s int) int {
		if s+1 < k {
			return n.segs[s+1]
		}
		return len(n.spec.Layers)
	}
	st := make([]layerState, len(n.spec.Layers))
	inputs := make([]Buf, k)
	h := n.input(p, b, rows)
	var mark int
	for s := 0; s < k && p.err == nil; s++ {
		inputs[s] = h
		mark = len(p.bufs)
		h = n.forwardRange(p, st, h, n.segs[s], end(s), rows)
		if s < k-1 && p.err == nil {
			p.release(mark, h) // the next segment's input is all that stays
		}
	}
	if p.err != nil {
		return fmt.Errorf("engine: forward: %w", p.err)
	}
	n.dev.SoftmaxXent(h, loss, h, labels, rows, n.spec.Classes, scale/float32(rows))
	dy := h
	wrote := false
	for s := k - 1; s >= 0; s-- {
		if s < k-1 {
			mark = len(p.bufs)
			p.recompute = true
			n.forwardRange(p, st, inputs[s], n.segs[s], end(s), rows)
		}
		if p.err == nil {
			dy = n.backwardRange(p, st, dy, n.segs[s], end(s), rows, beta)
		}
		if p.err != nil {
			// Part of the gradient is already added into an accumulating gradient, or
			// handed to the sink (which may have reduced it): it cannot be taken back.
			if (wrote && beta != 0) || n.wrote {
				return fmt.Errorf("%w: %v", ErrGradientLost, p.err)
			}
			return fmt.Errorf("engine: backward: %w", p.err)
		}
		wrote = true
		if !dy.Valid() {
			break // nothing below needs a gradient
		}
		p.release(mark, dy)
	}
	return nil
}

// labels validates and uploads the batch's labels.
func (n *Net) labels(p *pass, b *data.Batch) (Buf, error) {
	ys := make([]int32, b.N)
	for i := 0; i < b.N; i++ {
		y := int(b.Y[i])
		if y < 0 || y >= n.spec.Classes {
			return Buf{}, fmt.Errorf("%w: label %d of sample %d outside [0, %d)", ErrBatch, y, i, n.spec.Classes)
		}
		ys[i] = int32(y)
	}
	buf := p.alloc(b.N, I32)
	if p.err != nil {
		return Buf{}, fmt.Errorf("engine: labels: %w", p.err)
	}
	n.dev.UploadInt32(buf, ys)
	return buf, nil
}

// weight and bias return the device views of a layer's tensors.
func (n *Net) tensor(i int) Buf {
	t := n.layout.Tensors[i]
	return n.params.Slice(t.Offset, t.Offset+t.Size)
}

func (n *Net) gradOf(i int) (Buf, bool) {
	t := n.layout.Tensors[i]
	if t.Frozen {
		return Buf{}, false
	}
	off := t.Offset - n.layout.Frozen
	return n.grads.Slice(off, off+t.Size), true
}

// gradDone hands a finished tensor gradient to onGrad.
func (n *Net) gradDone(tensor int, g Buf) {
	if n.onGrad != nil {
		n.onGrad(g, n.layout.Tensors[tensor].Offset-n.layout.Frozen)
	}
}

// forward runs the layers on the first rows samples of b and returns each layer's state and
// the logits.
func (n *Net) forward(p *pass, b *data.Batch, rows int) ([]layerState, Buf) {
	x := n.input(p, b, rows)
	if p.err != nil {
		return nil, Buf{}
	}
	st := make([]layerState, len(n.spec.Layers))
	return st, n.forwardRange(p, st, x, 0, len(n.spec.Layers), rows)
}

// input uploads the first rows samples of b.
func (n *Net) input(p *pass, b *data.Batch, rows int) Buf {
	x := p.alloc(rows*b.SampleSize, n.dt)
	if p.err == nil {
		n.dev.Upload(x, b.X[:rows*b.SampleSize])
	}
	return x
}

// forwardRange runs layers [lo, hi) on h, recording their states in st, and returns the
// output (an invalid Buf after an allocation failure, which p holds).
func (n *Net) forwardRange(p *pass, st []layerState, h Buf, lo, hi, rows int) Buf {
	var skips []Buf // the inputs of the open residual branches
	for i := lo; i < hi; i++ {
		l := n.spec.Layers[i]
		st[i].in = h
		if n.waiter != nil {
			if err := n.waiter.WaitParams(n.paramEnd[i]); err != nil {
				p.fail(err)
				return Buf{}
			}
		}
		switch l.Kind {
		case model.Dense:
			r := rows * l.Rows()
			out := p.alloc(r*l.Out, n.dt)
			if p.err != nil {
				return Buf{}
			}
			n.dev.Gemm(false, false, r, l.Out, l.In, 1, h, n.tensor(l.Weight), 0, out)
			n.dev.AddBias(out, n.tensor(l.Bias), r, l.Out, false)
			h = out
		case model.Conv2D:
			cs := n.convShape(l, rows)
			mark := len(p.bufs)
			out := p.alloc(rows*prod(l.OutShape), n.dt)
			ws := n.convWorkspace(p, cs)
			if p.err != nil {
				return Buf{}
			}
			n.dev.Conv2D(out, h, n.tensor(l.Weight), n.tensor(l.Bias), ws, cs)
			p.release(mark, out) // the workspace goes back at once
			h = out
		case model.ReLU:
			n.dev.ReLU(h, h) // in place: the layer below needs only its input in backward
		case model.MaxPool2:
			c, hh, w := l.InShape[0], l.InShape[1], l.InShape[2]
			out := p.alloc(rows*prod(l.OutShape), n.dt)
			idx := p.alloc(rows*prod(l.OutShape), I32)
			if p.err != nil {
				return Buf{}
			}
			n.dev.MaxPool2(out, idx, h, rows*c, hh, w)
			st[i].idx = idx
			h = out
		case model.Flatten:
			// NCHW is already [rows, c·h·w] row-major.
		case model.LayerNorm:
			r := rows * l.Rows()
			out := p.alloc(r*l.Out, n.dt)
			st[i].aux, st[i].aux2 = p.alloc(r, F32), p.alloc(r, F32)
			if p.err != nil {
				return Buf{}
			}
			n.dev.LayerNorm(out, st[i].aux, st[i].aux2, h, n.tensor(l.Weight), n.tensor(l.Bias), r, l.Out, l.Eps)
			h = out
		case model.BatchNorm2d:
			h = n.batchNorm(p, st, i, h, rows)
		case model.GELU:
			out := p.alloc(h.N, n.dt)
			if p.err != nil {
				return Buf{}
			}
			n.dev.GELU(out, h) // a new buffer: the backward pass reads the input
			h = out
		case model.Dropout:
			if p.train {
				n.dev.Dropout(h, h, l.P, n.layerSeed(i)) // its backward needs only the seed
			}
		case model.Residual:
			skips = append(skips, h)
			if next := n.spec.Layers[i+1].Kind; next == model.ReLU || next == model.Dropout || next == model.Add {
				// The branch would start by writing over its input, which the Add needs.
				out := p.alloc(h.N, n.dt)
				if p.err != nil {
					return Buf{}
				}
				n.dev.Copy(out, h)
				h = out
			}
		case model.Add:
			if len(skips) == 0 {
				p.err = fmt.Errorf("engine: layer %d: add without its residual", i)
				return Buf{}
			}
			skip := skips[len(skips)-1]
			skips = skips[:len(skips)-1]
			if i > 0 && n.spec.Layers[i-1].Kind == model.ReLU {
				// ReLU's backward reads its output: add into a new buffer.
				out := p.alloc(h.N, n.dt)
				if p.err != nil {
					return Buf{}
				}
				n.dev.Copy(out, h)
				h = out
			}
			n.dev.Axpby(h, skip, 1, 1)
		case model.PatchEmbed:
			c, hh, w, pt := l.InShape[0], l.InShape[1], l.InShape[2], l.Patch
			t := l.OutShape[0]
			cols := p.alloc(rows*t*c*pt*pt, n.dt)
			out := p.alloc(rows*t*l.Out, n.dt)
			if p.err != nil {
				return Buf{}
			}
			n.dev.Patchify(cols, h, rows, c, hh, w, pt)
			n.dev.Gemm(false, true, rows*t, l.Out, c*pt*pt, 1, cols, n.tensor(l.Weight), 0, out)
			n.dev.AddBias(out, n.tensor(l.Bias), rows*t, l.Out, false)
			st[i].aux = cols
			h = out
		case model.Tokens:
			t, d := l.InShape[0], l.InShape[1]
			out := p.alloc(rows*(t+1)*d, n.dt)
			if p.err != nil {
				return Buf{}
			}
			n.dev.CopyRows(out, (t+1)*d, n.tensor(l.Weight), 0, rows, d)
			n.dev.CopyRows(out.Slice(d, out.N), (t+1)*d, h, t*d, rows, t*d)
			n.dev.AddBias(out, n.tensor(l.Bias), rows, (t+1)*d, false)
			h = out
		case model.Attention:
			h = n.attention(p, st, i, h, rows)
		case model.ClassPool:
			t, d := l.InShape[0], l.InShape[1]
			out := p.alloc(rows*d, n.dt)
			if p.err != nil {
				return Buf{}
			}
			n.dev.CopyRows(out, d, h, t*d, rows, d)
			h = out
		case model.MeanPool:
			h = n.meanPool(p, l, h, rows)
		default:
			p.err = fmt.Errorf("engine: layer kind %v not supported", l.Kind)
			return Buf{}
		}
		if p.err != nil {
			return Buf{}
		}
		st[i].out = h
	}
	return h
}

// attention is multi-head self-attention on the fused projections h = [Q K V] (rows × T ×
// 3D): per head, P = softmax(Q·Kᵀ/√dh) (kept for the backward pass) and the output P·V, the
// heads side by side (rows × T × D), as torch's scaled_dot_product_attention.
func (n *Net) attention(p *pass, st []layerState, i int, h Buf, rows int) Buf {
	l := n.spec.Layers[i]
	t, d, heads := l.InShape[0], l.Out, l.Heads
	dh := d / heads
	probs := p.alloc(rows*heads*t*t, n.dt)
	out := p.alloc(rows*t*d, n.dt)
	if p.err != nil {
		return Buf{}
	}
	for hd := 0; hd < heads; hd++ {
		q, k := h.Slice(hd*dh, h.N), h.Slice(d+hd*dh, h.N)
		n.dev.GemmBatched(false, true, t, t, dh, 1, q, 3*d, t*3*d, k, 3*d, t*3*d, 0, probs.Slice(hd*t*t, probs.N), t, heads*t*t, rows)
	}
	n.dev.Softmax(probs, probs, rows*heads*t, t, float32(1/math.Sqrt(float64(dh))))
	for hd := 0; hd < heads; hd++ {
		v := h.Slice(2*d+hd*dh, h.N)
		n.dev.GemmBatched(false, false, t, dh, t, 1, probs.Slice(hd*t*t, probs.N), t, heads*t*t, v, 3*d, t*3*d, 0, out.Slice(hd*dh, out.N), d, t*d, rows)
	}
	st[i].aux = probs
	return out
}

// attentionBackward propagates dy (rows × T × D) through attention layer i into dqkv, with
// dp (rows·heads·T·T) as workspace.
func (n *Net) attentionBackward(st layerState, l model.Layer, dy, dqkv, dp Buf, rows int) {
	t, d, heads := l.InShape[0], l.Out, l.Heads
	dh := d / heads
	x, probs := st.in, st.aux
	for hd := 0; hd < heads; hd++ {
		dyh, v := dy.Slice(hd*dh, dy.N), x.Slice(2*d+hd*dh, x.N)
		ph, dph := probs.Slice(hd*t*t, probs.N), dp.Slice(hd*t*t, dp.N)
		n.dev.GemmBatched(false, true, t, t, dh, 1, dyh, d, t*d, v, 3*d, t*3*d, 0, dph, t, heads*t*t, rows)
		n.dev.GemmBatched(true, false, t, dh, t, 1, ph, t, heads*t*t, dyh, d, t*d, 0, dqkv.Slice(2*d+hd*dh, dqkv.N), 3*d, t*3*d, rows)
	}
	n.dev.SoftmaxGrad(dp, dp, probs, rows*heads*t, t, float32(1/math.Sqrt(float64(dh))))
	for hd := 0; hd < heads; hd++ {
		q, k := x.Slice(hd*dh, x.N), x.Slice(d+hd*dh, x.N)
		dsh := dp.Slice(hd*t*t, dp.N)
		n.dev.GemmBatched(false, false, t, dh, t, 1, dsh, t, heads*t*t, k, 3*d, t*3*d, 0, dqkv.Slice(hd*dh, dqkv.N), 3*d, t*3*d, rows)
		n.dev.GemmBatched(true, false, t, dh, t, 1, dsh, t, heads*t*t, q, 3*d, t*3*d, 0, dqkv.Slice(d+hd*dh, dqkv.N), 3*d, t*3*d, rows)
	}
}

// meanPool averages an image's planes ([C, H, W] → [C]) or a sequence's tokens ([T, D] →
// [D]).
func (n *Net) meanPool(p *pass, l model.Layer, h Buf, rows int) Buf {
	out := p.alloc(rows*l.OutShape[0], n.dt)
	if p.err != nil {
		return Buf{}
	}
	if len(l.InShape) == 3 {
		hw := l.InShape[1] * l.InShape[2]
		n.dev.SumRows(out, h, rows*l.InShape[0], hw, true, 0)
		n.dev.Axpby(out, out, 1/float32(hw), 0)
		return out
	}
	t, d := l.InShape[0], l.InShape[1]
	ones := p.onesOf(t)
	if p.err != nil {
		return Buf{}
	}
	n.dev.GemmBatched(false, false, 1, d, t, 1/float32(t), ones, t, 0, h, d, t*d, 0, out, d, d, rows)
	return out
}

// meanPoolBackward spreads dy evenly over the pooled elements into dx.
func (n *Net) meanPoolBackward(p *pass, l model.Layer, dx, dy Buf, rows int) {
	if len(l.InShape) == 3 {
		hw := l.InShape[1] * l.InShape[2]
		ones := p.onesOf(hw)
		if p.err == nil {
			n.dev.Gemm(false, false, rows*l.InShape[0], hw, 1, 1/float32(hw), dy, ones, 0, dx)
		}
		return
	}
	t, d := l.InShape[0], l.InShape[1]
	ones := p.onesOf(t)
	if p.err == nil {
		n.dev.GemmBatched(false, false, t, d, 1, 1/float32(t), ones, 1, 0, dy, d, d, 0, dx, d, t*d, rows)
	}
}

// batchNorm is a BatchNorm2d layer's forward pass: in training with the batch's statistics,
// which also update the running ones (once per pass, not again when a checkpointed segment
// is recomputed); in evaluation with the running statistics.
func (n *Net) batchNorm(p *pass, st []layerState, i int, h Buf, rows int) Buf {
	l := n.spec.Layers[i]
	c, hw := l.InShape[0], l.InShape[1]*l.InShape[2]
	out := p.alloc(h.N, n.dt)
	mean, rstd := p.alloc(c, F32), p.alloc(c, F32)
	if p.err != nil {
		return Buf{}
	}
	rm, rv := n.layout.Tensors[l.RunMean], n.layout.Tensors[l.RunVar]
	runMean, runVar := n.host[rm.Offset:rm.Offset+rm.Size], n.host[rv.Offset:rv.Offset+rv.Size]
	if !p.train {
		r := make([]float32, c)
		for j := range r {
			r[j] = float32(1 / math.Sqrt(float64(runVar[j])+float64(l.Eps)))
		}
		n.dev.Upload(mean, runMean)
		n.dev.Upload(rstd, r)
		n.dev.BatchNorm(out, mean, rstd, h, n.tensor(l.Weight), n.tensor(l.Bias), rows, c, hw, l.Eps, false)
		return out
	}
	n.dev.BatchNorm(out, mean, rstd, h, n.tensor(l.Weight), n.tensor(l.Bias), rows, c, hw, l.Eps, true)
	st[i].aux, st[i].aux2 = mean, rstd
	if p.recompute {
		return out
	}
	m, r := make([]float32, c), make([]float32, c)
	if err := n.dev.Download(m, mean); err != nil {
		p.fail(err)
		return Buf{}
	}
	if err := n.dev.Download(r, rstd); err != nil {
		p.fail(err)
		return Buf{}
	}
	// PyTorch's update: the running variance takes the unbiased batch variance.
	cnt := float64(rows * hw)
	mom := float64(l.Momentum)
	for j := 0; j < c; j++ {
		v := 1/(float64(r[j])*float64(r[j])) - float64(l.Eps)
		if cnt > 1 {
			v *= cnt / (cnt - 1)
		}
		runMean[j] = float32((1-mom)*float64(runMean[j]) + mom*float64(m[j]))
		runVar[j] = float32((1-mom)*float64(runVar[j]) + mom*v)
	}
	if !n.viewed {
		n.dev.Upload(n.tensor(l.RunMean), runMean)
		n.dev.Upload(n.tensor(l.RunVar), runVar)
	}
	return out
}

// convShape is layer l's convolution over rows samples.
func (n *Net) convShape(l model.Layer, rows int) ConvShape {
	return ConvShape{N: rows, C: l.InShape[0], H: l.InShape[1], W: l.InShape[2], Out: l.Out, K: l.Kernel, Pad: l.Pad}
}

// convWorkspace allocates what the device wants for a convolution (an invalid Buf for none).
func (n *Net) convWorkspace(p *pass, s ConvShape) Buf {
	if wn, wt := n.dev.ConvWorkspace(s, n.dt); wn > 0 {
		return p.alloc(wn, wt)
	}
	return Buf{}
}

// bwdBufs is one layer's backward workspace.
type bwdBufs struct{ dx, ws Buf }

// backwardBuffers allocates the whole backward pass's workspace before any gradient is
// written, so an out-of-memory failure never leaves a gradient half written. A buffer is
// dead once the layer below has read it, so the input gradients take turns in two buffers
// (the one a layer reads from, the one it writes to), and each other kind of workspace (an
// attention's probabilities' gradient, a convolution's unfolding, the class token's rows, the
// gradient a residual branch's input waits for at each nesting level) has one buffer of the
// largest size any layer needs: the workspace of a deep model is that of about two layers,
// not of all of them.
func (n *Net) backwardBuffers(p *pass, lo, hi, rows int) []bwdBufs {
	ws := make([]bwdBufs, len(n.spec.Layers))
	if n.onesN > 0 {
		p.onesOf(n.onesN) // pooling's ones, before any gradient is written
	}
	type slot struct {
		size int
		t    DType
		uses []*Buf
		lens []int
	}
	slots := map[string]*slot{}
	var order []string
	use := func(key string, dst *Buf, size int, t DType) {
		sl := slots[key]
		if sl == nil {
			sl = &slot{t: t}
			slots[key] = sl
			order = append(order, key)
		}
		sl.size = max(sl.size, size)
		sl.uses = append(sl.uses, dst)
		sl.lens = append(sl.lens, size)
	}
	cur := -1 // the gradient buffer the current dy lies in (-1: the caller's)
	grad := func(dst *Buf, size int) {
		next := 0
		if cur == 0 {
			next = 1
		}
		use(fmt.Sprintf("grad%d", next), dst, size, n.dt)
		cur = next
	}
	depth := 0
plan:
	for i := hi - 1; i >= lo; i-- {
		l := n.spec.Layers[i]
		in := rows * prod(l.InShape)
		if !l.Kind.HasParams() && !n.needDx[i] {
			break
		}
		if l.Kind == model.Tokens && !n.layout.Tensors[l.Weight].Frozen {
			// The class token's gradient is the sum of the batch's token-0 gradients.
			use("tokens", &ws[i].ws, rows*l.Out, n.dt)
		}
		switch l.Kind {
		case model.Dense, model.PatchEmbed, model.Tokens:
			if !n.needDx[i] {
				break plan
			}
			grad(&ws[i].dx, in)
		case model.Conv2D:
			if wn, wt := n.dev.ConvWorkspace(n.convShape(l, rows), n.dt); wn > 0 {
				use("conv-"+wt.String(), &ws[i].ws, wn, wt)
			}
			if !n.needDx[i] {
				break plan
			}
			grad(&ws[i].dx, in)
		case model.LayerNorm, model.BatchNorm2d:
			if !n.needDx[i] {
				break plan
			}
		case model.MaxPool2, model.ClassPool, model.MeanPool:
			grad(&ws[i].dx, in)
		case model.Add:
			use(fmt.Sprintf("skip%d", depth), &ws[i].ws, in, n.dt) // the skip's copy of the gradient
			depth++
		case model.Residual:
			depth--
		case model.Attention:
			use("attention", &ws[i].ws, rows*l.Heads*l.InShape[0]*l.InShape[0], n.dt)
			grad(&ws[i].dx, in)
		}
	}
	for _, key := range order {
		sl := slots[key]
		b := p.alloc(sl.size, sl.t)
		if p.err != nil {
			return ws
		}
		for k, dst := range sl.uses {
			*dst = b.Slice(0, sl.lens[k])
		}
	}
	return ws
}

// backward propagates dy (the logits' gradient) down the layers, setting each trainable
// tensor's gradient to beta × itself plus this pass's (see grad).
func (n *Net) backward(p *pass, st []layerState, dy Buf, rows int, beta float32) {
	n.backwardRange(p, st, dy, 0, len(n.spec.Layers), rows, beta)
}

// backwardRange propagates dy, the gradient at layer hi-1's output, down through layers
// [lo, hi) and returns the gradient at layer lo's input, or an invalid Buf when nothing below
// needs it (or something failed, which p holds). All the range's workspace is allocated
// before its first gradient write. Within a layer the bias's gradient (higher in the flat
// space) goes before the weight's, and a Linear weight's from its last rows: the pieces reach
// the sink from the top.
func (n *Net) backwardRange(p *pass, st []layerState, dy Buf, lo, hi, rows int, beta float32) Buf {
	ws := n.backwardBuffers(p, lo, hi, rows)
	if p.err != nil {
		return Buf{}
	}
	trainable := func(ti int) bool { return ti >= 0 && !n.layout.Tensors[ti].Frozen }
	var skips []Buf // the gradients waiting at the open residual branches' inputs
	for i := hi - 1; i >= lo; i-- {
		l := n.spec.Layers[i]
		s, w := st[i], ws[i]
		if !l.Kind.HasParams() && !n.needDx[i] {
			return Buf{} // nothing below needs a gradient
		}
		switch l.Kind {
		case model.Dense:
			r := rows * l.Rows()
			if trainable(l.Bias) {
				p.fail(n.grad(l.Bias, beta, func(g Buf, beta float32, _, _ int) {
					n.dev.SumRows(g, dy, r, l.Out, false, beta)
				}))
			}
			if trainable(l.Weight) && p.err == nil {
				// The weight is stored [in, out]: rows [r0, r1) of its gradient are the
				// input's columns r0..r1 (transposed) times dy.
				p.fail(n.grad(l.Weight, beta, func(g Buf, beta float32, lo, hi int) {
					r0, r1 := lo/l.Out, hi/l.Out
					x := s.in.Slice(r0, r0+StridedLen(r, r1-r0, l.In))
					n.dev.GemmLD(true, false, r1-r0, l.Out, r, 1, x, l.In, dy, l.Out, beta, g, l.Out)
				}))
			}
			if p.err != nil || !n.needDx[i] {
				return Buf{}
			}
			n.dev.Gemm(false, true, r, l.In, l.Out, 1, dy, n.tensor(l.Weight), 0, w.dx)
			dy = w.dx
		case model.Conv2D:
			p.fail(n.convGrads(i, s.in, dy, w, rows, beta))
			if p.err != nil || !n.needDx[i] {
				return Buf{}
			}
			dy = w.dx
		case model.ReLU:
			n.dev.ReLUGrad(dy, dy, s.out)
		case model.MaxPool2:
			n.dev.MaxPool2Grad(w.dx, dy, s.idx)
			dy = w.dx
		case model.Flatten:
		case model.LayerNorm, model.BatchNorm2d:
			dx := Buf{}
			if n.needDx[i] {
				dx = dy // in place
			}
			p.fail(n.pairGrads(l, beta, func(dg, db Buf, beta float32) {
				if l.Kind == model.LayerNorm {
					r := rows * l.Rows()
					n.dev.LayerNormBackward(dx, dg, db, dy, s.in, s.aux, s.aux2, n.tensor(l.Weight), r, l.Out, beta)
				} else {
					n.dev.BatchNormBackward(dx, dg, db, dy, s.in, s.aux, s.aux2, n.tensor(l.Weight), rows, l.Out, l.InShape[1]*l.InShape[2], beta)
				}
			}))
			if p.err != nil || !n.needDx[i] {
				return Buf{}
			}
		case model.GELU:
			n.dev.GELUGrad(dy, dy, s.in)
		case model.Dropout:
			n.dev.Dropout(dy, dy, l.P, n.layerSeed(i))
		case model.Add:
			// The gradient goes down the branch and, unchanged, to the branch's input.
			n.dev.Copy(w.ws, dy)
			skips = append(skips, w.ws)
		case model.Residual:
			if len(skips) == 0 {
				p.fail(fmt.Errorf("engine: layer %d: residual without its add", i))
				return Buf{}
			}
			n.dev.Axpby(dy, skips[len(skips)-1], 1, 1)
			skips = skips[:len(skips)-1]
		case model.PatchEmbed:
			c, hh, wd, pt := l.InShape[0], l.InShape[1], l.InShape[2], l.Patch
			r, k := rows*l.OutShape[0], c*pt*pt
			if trainable(l.Bias) {
				p.fail(n.grad(l.Bias, beta, func(g Buf, beta float32, _, _ int) {
					n.dev.SumRows(g, dy, r, l.Out, false, beta)
				}))
			}
			if trainable(l.Weight) && p.err == nil {
				p.fail(n.grad(l.Weight, beta, func(g Buf, beta float32, _, _ int) {
					n.dev.Gemm(true, false, l.Out, k, r, 1, dy, s.aux, beta, g)
				}))
			}
			if p.err != nil || !n.needDx[i] {
				return Buf{}
			}
			// dx through a patches-sized buffer: the forward's patches are no longer needed.
			n.dev.Gemm(false, false, r, k, l.Out, 1, dy, n.tensor(l.Weight), 0, s.aux)
			n.dev.Unpatchify(w.dx, s.aux, rows, c, hh, wd, pt)
			dy = w.dx
		case model.Tokens:
			t, d := l.InShape[0], l.InShape[1]
			if trainable(l.Bias) {
				p.fail(n.grad(l.Bias, beta, func(g Buf, beta float32, _, _ int) {
					n.dev.SumRows(g, dy, rows, (t+1)*d, false, beta)
				}))
			}
			if trainable(l.Weight) && p.err == nil {
				p.fail(n.grad(l.Weight, beta, func(g Buf, beta float32, _, _ int) {
					n.dev.CopyRows(w.ws, d, dy, (t+1)*d, rows, d)
					n.dev.SumRows(g, w.ws, rows, d, false, beta)
				}))
			}
			if p.err != nil || !n.needDx[i] {
				return Buf{}
			}
			n.dev.CopyRows(w.dx, t*d, dy.Slice(d, dy.N), (t+1)*d, rows, t*d)
			dy = w.dx
		case model.Attention:
			n.attentionBackward(s, l, dy, w.dx, w.ws, rows)
			dy = w.dx
		case model.ClassPool:
			t, d := l.InShape[0], l.InShape[1]
			n.dev.Fill(w.dx, 0)
			n.dev.CopyRows(w.dx, t*d, dy, d, rows, d)
			dy = w.dx
		case model.MeanPool:
			n.meanPoolBackward(p, l, w.dx, dy, rows)
			dy = w.dx
		}
		if p.err != nil {
			return Buf{}
		}
	}
	return dy
}

// pairGrads runs a layer whose one kernel makes both its weight and bias gradients, whole
// (Conv2D, LayerNorm, BatchNorm2d): it takes both pieces from the sink (bias first: it lies higher),
// calls compute with them (an invalid Buf for a frozen one) and gives them back.
func (n *Net) pairGrads(l model.Layer, beta float32, compute func(dw, db Buf, beta float32)) error {
	wTrain, bTrain := !n.layout.Tensors[l.Weight].Frozen, !n.layout.Tensors[l.Bias].Frozen
	if n.sink == nil {
		var dw, db Buf
		if wTrain {
			dw, _ = n.gradOf(l.Weight)
		}
		if bTrain {
			db, _ = n.gradOf(l.Bias)
		}
		compute(dw, db, beta)
		if bTrain {
			n.gradDone(l.Bias, db)
		}
		if wTrain {
			n.gradDone(l.Weight, dw)
		}
		return nil
	}
	var pb, pw piece
	var err error
	if bTrain {
		x := n.extent[l.Bias]
		if pb, err = n.acquire(x.Off, x.Off+x.Size); err != nil {
			return err
		}
	}
	if wTrain {
		x := n.extent[l.Weight]
		if pw, err = n.acquire(x.Off, x.Off+x.Size); err != nil {
			return err
		}
	}
	if pb.g.Valid() && pw.g.Valid() && pb.beta != pw.beta {
		return errors.New("engine: the sink wants the bias and the weight of one layer accumulated differently")
	}
	compute(pw.g, pb.g, max(pb.beta, pw.beta))
	if bTrain {
		if err := n.release(pb); err != nil {
			return err
		}
	}
	if wTrain {
		return n.release(pw)
	}
	return nil
}

// convGrads runs a convolution's backward pass: its weight and bias gradients (those that
// are trained) and, when a layer below needs it, the input gradient into w.dx.
func (n *Net) convGrads(i int, x, dy Buf, w bwdBufs, rows int, beta float32) error {
	l := n.spec.Layers[i]
	dx := Buf{}
	if n.needDx[i] {
		dx = w.dx
	}
	return n.pairGrads(l, beta, func(dw, db Buf, beta float32) {
		n.dev.Conv2DBackward(dx, dw, db, dy, x, n.tensor(l.Weight), w.ws, n.convShape(l, rows), beta)
	})
}

// Evaluate runs the forward pass on the first b.N (<= EvalBatch) samples and sums their loss
// and correct predictions (the logits come back to the host: rows × classes values).
func (n *Net) Evaluate(b *data.Batch) (model.EvalResult, error) {
	in := prod(n.spec.Input)
	if b.N < 0 || b.N > n.evalBS || b.SampleSize != in {
		return model.EvalResult{}, fmt.Errorf("%w: evaluation takes up to %d samples of %d values, got %d of %d", ErrBatch, n.evalBS, in, b.N, b.SampleSize)
	}
	if b.N == 0 {
		return model.EvalResult{}, nil
	}
	p := &pass{n: n}
	defer p.free()
	// Nothing is kept for a backward pass: each layer's input goes back to the allocator as
	// soon as the layer has run, so the evaluation batch (often larger than the micro-batch)
	// holds about two layers' activations at a time.
	// A residual branch runs as one range: its input stays until its add.
	st := make([]layerState, len(n.spec.Layers))
	logits := n.input(p, b, b.N)
	depth, lo := 0, 0
	for i, l := range n.spec.Layers {
		switch l.Kind {
		case model.Residual:
			depth++
		case model.Add:
			depth--
		}
		if depth > 0 || p.err != nil {
			continue
		}
		logits = n.forwardRange(p, st, logits, lo, i+1, b.N)
		p.release(0, logits)
		lo = i + 1
	}
	if p.err != nil {
		return model.EvalResult{}, fmt.Errorf("engine: evaluation forward: %w", p.err)
	}
	classes := n.spec.Classes
	z := make([]float32, b.N*classes)
	if err := n.dev.Download(z, logits); err != nil {
		return model.EvalResult{}, fmt.Errorf("engine: evaluation forward: %w", err)
	}
	return model.Score(z, b.Y, b.N, classes)
}

// ReleaseCache gives the allocator's cached blocks back to the device (the OS, on the CPU):
// the trainer calls it after an evaluation, whose batch-sized blocks the training steps
// would not reuse (torch.cuda.empty_cache after validation, done for the user).
func (n *Net) ReleaseCache() { n.alloc.EmptyCache() }

func prod(s []int) int {
	p := 1
	for _, v := range s {
		p *= v
	}
	return p
}
