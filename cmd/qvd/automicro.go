package main

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/trainer"
)

// microBatchFlag is --micro-batch: a number, or auto.
type microBatchFlag int

func (m *microBatchFlag) String() string {
	if m == nil || int(*m) == 0 {
		return ""
	}
	if int(*m) == trainer.AutoMicroBatch {
		return "auto"
	}
	return strconv.Itoa(int(*m))
}

func (m *microBatchFlag) Set(s string) error {
	if s == "auto" {
		*m = trainer.AutoMicroBatch
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("want a number of samples or auto")
	}
	// trainer.AutoMicroBatch (-1) is how auto is stored, so a negative number must not be
	// let through: -1 would silently mean auto. Only the word auto means auto.
	if n < 1 || n > maxMicroBatch {
		return fmt.Errorf("train.micro_batch: must be in [1, %d] or auto, got %d", maxMicroBatch, n)
	}
	*m = microBatchFlag(n)
	return nil
}

// maxMicroBatch is trainer.Config.Validate's upper bound on train.micro_batch.
const maxMicroBatch = 1 << 20

// autoMicro is what resolveAutoMicro decided, for the log.
type autoMicro struct {
	micro, accum      int
	budget, states    int64
	perSample, probed int64
	tried             []int
	budgetFrom        string // where the budget comes from: the device, memory.limit, the host or the cgroup
}

// dataShape is the model's input shape and class count for cfg: the data's (headers and file
// lists only), or, where the data cannot be read, what model.input and model.classes
// declare.
func dataShape(cfg *configs.Config) ([]int, int, error) {
	s, err := data.Describe(cfg.Data)
	if err == nil {
		return s.Input(), s.Classes, nil
	}
	if len(cfg.Model.Input) == 3 && cfg.Model.Classes > 0 {
		return cfg.Model.Input, cfg.Model.Classes, nil
	}
	return nil, 0, fmt.Errorf("the model's input shape and classes come from the data (or from model.input and model.classes): %w", err)
}

// sampleSize is the number of values in one input sample of spec.
func sampleSize(spec *model.Spec) int {
	n := 1
	for _, d := range spec.Input {
		n *= d
	}
	return n
}

// budgetFor is the memory one worker may use when micro_batch is auto: the memory this
// process can still have — the smaller of the machine's available memory and its memory
// cgroup's limit less its working set (docker --memory, a SLURM job's allocation) — shared
// by the world's workers (conservative on a multi-node job, where a node holds fewer of
// them; memory.limit, where set and lower, is the better figure), and which limit that is.
var budgetFor = func(cfg *configs.Config, world int) (int64, string) {
	r := memstat.NewReader()
	defer r.Close()
	s := r.Read()
	return int64(s.Available) / int64(world), fmt.Sprintf("%s, shared by %d worker(s)", s.LimitString(), world)
}

// resolveAutoMicro turns train.micro_batch: auto into numbers: the largest micro-batch whose
// model states and activations fit the memory budget less the estimate's headroom and that
// divides the per-worker share of train.effective_batch exactly, with accum making up the
// rest, so micro × accum × world = effective batch. The activation bytes per sample are
// measured on the model (two graph sizes), and the choice is then probed: the model is built
// at that micro-batch and one forward/backward run, and if the heap it took does not fit, the
// next smaller divisor is tried. It fails, naming the figures, when nothing fits or the
// effective batch does not divide among the workers.
func resolveAutoMicro(cfg *configs.Config, world int) (*autoMicro, error) {
	if cfg.Train.MicroBatch != trainer.AutoMicroBatch {
		return nil, nil
	}
	eff := cfg.Train.EffectiveBatch
	switch {
	case eff < 1:
		return nil, errors.New("train.micro_batch: auto needs train.effective_batch (--effective-batch), the global batch to keep")
	case eff%world != 0:
		return nil, fmt.Errorf("train.micro_batch: auto: train.effective_batch %d is not a multiple of the %d workers, so micro × accum × world cannot equal it", eff, world)
	}
	input, classes, err := dataShape(cfg)
	if err != nil {
		return nil, fmt.Errorf("train.micro_batch: auto: %w", err)
	}
	spec, err := model.NewSpec(cfg.Model, input, classes)
	if err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	f, err := half.ParseFormat(cfg.Train.Precision)
	if err != nil {
		return nil, fmt.Errorf("train.precision: %w", err)
	}
	layout := model.NewLayout(spec)
	in := estimateInput{elems: layout.Size, numParams: layout.NumParams(), world: world, stage: cfg.Zero.Stage, offload: cfg.Zero.Offload(),
		precision: cfg.Train.Precision, optimizer: cfg.Optimizer.Type, momentum: cfg.Optimizer.Momentum, bucket: cfg.Zero.ReduceBucketSize}
	probe, err := newMicroProbe(cfg, world)
	if err != nil {
		return nil, fmt.Errorf("train.micro_batch: auto: %w", err)
	}
	defer probe.close()
	a := &autoMicro{budget: probe.budget, budgetFrom: probe.budgetFrom}
	if a.perSample, err = probe.perSample(spec, f); err != nil {
		return nil, fmt.Errorf("train.micro_batch: auto: measuring activation memory: %w", err)
	}
	rec, err := in.recommend(a.budget, int64(eff), a.perSample)
	if err != nil {
		return nil, fmt.Errorf("train.micro_batch: auto (budget %s per worker, from %s): %w", humanBytes(a.budget), a.budgetFrom, err)
	}
	a.states = rec.states
	perWorker := eff / world
	for micro := int(rec.micro); micro >= 1; micro-- {
		if perWorker%micro != 0 {
			continue
		}
		a.tried = append(a.tried, micro)
		used, err := probe.at(spec, layout, f, micro)
		if errors.Is(err, memory.ErrOutOfMemory) {
			continue // the device could not hold it: try a smaller one
		}
		if err != nil {
			return nil, fmt.Errorf("train.micro_batch: auto: probing micro-batch %d: %w", micro, err)
		}
		if rec.states+used <= rec.usable { // conservative: the heap holds a copy of the weights too
			a.micro, a.accum, a.probed = micro, perWorker/micro, used
			cfg.Train.MicroBatch, cfg.Train.Accum = a.micro, a.accum
			return a, nil
		}
	}
	return nil, fmt.Errorf("train.micro_batch: auto: no micro-batch dividing %d fits %s of the %s budget per worker (from %s) after the model states (%s); tried %v",
		perWorker, humanBytes(rec.usable-rec.states), humanBytes(a.budget), a.budgetFrom, humanBytes(rec.states), a.tried)
}

// microProbe measures micro-batches on the engine the job trains with: the Go heap of the
// gorgonia engine, or the native engine's device allocator (its peak over one
// forward/backward: the activations and workspace, and on a GPU the weights and gradient),
// against that engine's budget.
type microProbe struct {
	budget     int64
	budgetFrom string
	perSample  func(spec *model.Spec, f half.Format) (int64, error)
	at         func(spec *model.Spec, layout *model.Layout, f half.Format, micro int) (int64, error)
	close      func()
}

func newMicroProbe(cfg *configs.Config, world int) (*microProbe, error) {
	if cfg.Engine == configs.EngineGorgonia {
		p := &microProbe{perSample: measureActivationBytes, at: probeMicro, close: func() {}}
		p.budget, p.budgetFrom = budgetFor(cfg, world)
		return p, nil
	}
	var dev engine.Device
	if cfg.Device.GPU() {
		d, err := engine.Open(cfg.Device, localRank(0))
		if err != nil {
			return nil, err
		}
		dev = d
	} else {
		d, err := newCPUDevice(nil, cfg.Train.Threads, uint64(cfg.Memory.Limit))
		if err != nil {
			return nil, err
		}
		dev = d
	}
	alloc := engine.NewAllocator(dev)
	p := &microProbe{close: func() { alloc.Close(); dev.Close() }}
	// The device's memory, shared by the workers that may share it (all of them, at worst,
	// as with qvd launch on one GPU); on the CPU, memory.limit is this worker's own budget;
	// a device that does not say (the CPU backend without memory.limit, the reference) uses
	// the host's figure.
	p.budget = int64(dev.TotalMemory()) / int64(world)
	p.budgetFrom = fmt.Sprintf("the device's %s shared by %d worker(s)", humanBytes(int64(dev.TotalMemory())), world)
	if !cfg.Device.GPU() {
		p.budget, p.budgetFrom = int64(cfg.Memory.Limit), "memory.limit "+cfg.Memory.Limit.String()
		// memory.limit is only the Go runtime's soft limit: in a container or a job's cgroup
		// with less memory than that, the cgroup's figure is the one that binds.
		if p.budget > 0 {
			if avail, from := budgetFor(cfg, world); avail < p.budget {
				p.budget, p.budgetFrom = avail, from+", below memory.limit "+cfg.Memory.Limit.String()
			}
		}
	}
	if p.budget == 0 {
		p.budget, p.budgetFrom = budgetFor(cfg, world)
	}
	p.at = func(spec *model.Spec, layout *model.Layout, f half.Format, micro int) (int64, error) {
		return deviceAfterStep(alloc, spec, layout, f, micro)
	}
	p.perSample = func(spec *model.Spec, f half.Format) (int64, error) {
		layout := model.NewLayout(spec)
		// Small batches, so that the measurement itself fits a small device.
		const small, large = 2, 10
		a, err := p.at(spec, layout, f, small)
		if err != nil {
			return 0, err
		}
		b, err := p.at(spec, layout, f, large)
		if err != nil {
			return 0, err
		}
		if b <= a {
			return 0, fmt.Errorf("no growth of device memory with the batch (%d bytes at %d samples, %d at %d)", a, small, b, large)
		}
		return (b - a) / (large - small), nil
	}
	return p, nil
}

// deviceAfterStep builds the native engine at micro and runs one forward/backward, returning
// the allocator's peak: the step's activations and workspace (and on a GPU the weights and
// gradient).
func deviceAfterStep(alloc *engine.Allocator, spec *model.Spec, layout *model.Layout, f half.Format, micro int) (int64, error) {
	params := make([]float32, layout.Size)
	model.Init(spec, layout, params, 1)
	alloc.ResetPeaks()
	net, err := engine.NewNet(alloc, spec, layout, params, engine.Options{MicroBatch: micro, EvalBatch: 1, Precision: f})
	if err != nil {
		return 0, err
	}
	defer net.Close()
	b := data.NewBatch(micro, sampleSize(spec))
	b.N = micro
	if _, err := net.ForwardBackward(b, 1, model.FlatSink(make([]float32, layout.Trainable()))); err != nil {
		return 0, err
	}
	return alloc.Stats().MaxAllocated, nil
}

// probeMicro builds the training graph at micro and runs one forward/backward, returning the
// Go heap in use at that point: the whole of it, not the growth, because gorgonia keeps freed
// tensors in pools that a later graph borrows from (so a difference would miss them), and
// because it is the process's footprint that has to fit.
func probeMicro(spec *model.Spec, layout *model.Layout, f half.Format, micro int) (int64, error) {
	params := make([]float32, layout.Size)
	model.Init(spec, layout, params, 1)
	return heapAfterStep(spec, layout, params, make([]float32, layout.Size), f, micro)
}

// heapAfterStep builds the training graph at micro over params and runs one forward/backward
// of a blank batch into grads, and returns the Go heap in use (after a collection) while the
// graph is still alive.
func heapAfterStep(spec *model.Spec, layout *model.Layout, params, grads []float32, f half.Format, micro int) (int64, error) {
	net, err := model.New(spec, layout, params, model.Options{MicroBatch: micro, EvalBatch: 1, Grad: f})
	if err != nil {
		return 0, err
	}
	defer net.Close()
	b := data.NewBatch(micro, sampleSize(spec))
	b.N = micro
	if _, err := net.ForwardBackward(b, 1, model.FlatSink(grads[layout.Frozen:])); err != nil {
		return 0, err
	}
	used := heapInUse()
	runtime.KeepAlive(net)
	runtime.KeepAlive(b)
	return used, nil
}

func heapInUse() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}
