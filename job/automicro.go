package job

import (
	"errors"
	"fmt"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/job/estimate"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/trainer"
)

// Resolve finishes a configuration built from defaults, YAML, a DeepSpeed JSON (ds) and flags
// for a job of world processes: the DeepSpeed batch check, micro_batch: auto
// (ResolveAutoMicro), the derived defaults and validation. It returns the warnings to show;
// its errors are configs.ErrInvalid.
func Resolve(cfg *configs.Config, ds configs.DeepSpeedResult, world int, o AutoOptions) ([]string, error) {
	if err := ds.CheckBatch(cfg, world); err != nil {
		return nil, err
	}
	auto, err := ResolveAutoMicro(cfg, world, o)
	if err != nil {
		return nil, fmt.Errorf("%w: %w", configs.ErrInvalid, err)
	}
	if auto != nil {
		ds.Warnings = append(ds.Warnings, auto.Summary(world, cfg.Train.EffectiveBatch))
	}
	cfg.Resolve()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%w:\n  %w", configs.ErrInvalid, err)
	}
	return ds.Warnings, nil
}

// AutoMicro is what ResolveAutoMicro decided, for the log.
type AutoMicro struct {
	Micro, Accum      int
	Budget, States    int64
	PerSample, Probed int64
	Tried             []int
	BudgetFrom        string // where the budget comes from: the device, memory.limit, the host or the cgroup
}

// Summary is the warning qvd prints about the choice, for a job of world workers and an
// effective batch of effective.
func (a *AutoMicro) Summary(world, effective int) string {
	return fmt.Sprintf("micro_batch: auto chose micro-batch %d × accum %d × %d worker(s) = %d (budget %s per worker from %s, model states %s, activations %s per sample measured; the Go heap at the probe at %d: %s)",
		a.Micro, a.Accum, world, effective, fmtBytes(a.Budget), a.BudgetFrom, fmtBytes(a.States), fmtBytes(a.PerSample), a.Micro, fmtBytes(a.Probed))
}

// Budget is the memory one of world workers may use when micro_batch is auto, and which
// limit that is, in words.
type Budget func(cfg *configs.Config, world int) (int64, string)

// HostBudget is the memory this process can still have — the smaller of the machine's
// available memory and its memory cgroup's limit less its working set (docker --memory, a
// SLURM job's allocation) — shared by the world's workers (conservative on a multi-node job,
// where a node holds fewer of them; memory.limit, where set and lower, is the better figure).
func HostBudget(_ *configs.Config, world int) (int64, string) {
	r := memstat.NewReader()
	defer r.Close()
	s := r.Read()
	return int64(s.Available) / int64(world), fmt.Sprintf("%s, shared by %d worker(s)", s.LimitString(), world)
}

// AutoOptions are ResolveAutoMicro's seams.
type AutoOptions struct {
	// Budget is the host's memory budget per worker; nil is HostBudget.
	Budget Budget
	// LocalRank picks the GPU the probe measures on (LocalRank).
	LocalRank int
}

// ResolveAutoMicro turns train.micro_batch: auto into numbers: the largest micro-batch whose
// model states and activations fit the memory budget less the estimate's headroom and that
// divides the per-worker share of train.effective_batch exactly, with accum making up the
// rest, so micro × accum × world = effective batch. The activation bytes per sample are
// measured on the model (two graph sizes), and the choice is then probed: the model is built
// at that micro-batch and one forward/backward run, and if the memory it took does not fit,
// the next smaller divisor is tried. It fails, naming the figures, when nothing fits or the
// effective batch does not divide among the workers. A config without auto is left alone
// (nil, nil).
func ResolveAutoMicro(cfg *configs.Config, world int, o AutoOptions) (*AutoMicro, error) {
	if cfg.Train.MicroBatch != trainer.AutoMicroBatch {
		return nil, nil
	}
	if o.Budget == nil {
		o.Budget = HostBudget
	}
	eff := cfg.Train.EffectiveBatch
	switch {
	case eff < 1:
		return nil, errors.New("train.micro_batch: auto needs train.effective_batch (--effective-batch), the global batch to keep")
	case eff%world != 0:
		return nil, fmt.Errorf("train.micro_batch: auto: train.effective_batch %d is not a multiple of the %d workers, so micro × accum × world cannot equal it", eff, world)
	}
	input, classes, err := DataShape(cfg)
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
	in := estimate.Input{Elems: layout.Size, World: world, Stage: cfg.Zero.Stage, Offload: cfg.Zero.Offload(),
		Format: f, Optimizer: cfg.Optimizer, Bucket: cfg.Zero.ReduceBucketSize}
	probe, err := newMicroProbe(cfg, world, o)
	if err != nil {
		return nil, fmt.Errorf("train.micro_batch: auto: %w", err)
	}
	defer probe.close()
	a := &AutoMicro{Budget: probe.budget, BudgetFrom: probe.budgetFrom}
	if a.PerSample, err = probe.perSample(spec, f); err != nil {
		return nil, fmt.Errorf("train.micro_batch: auto: measuring activation memory: %w", err)
	}
	rec, err := in.Recommend(a.Budget, int64(eff), a.PerSample)
	if err != nil {
		return nil, fmt.Errorf("train.micro_batch: auto (budget %s per worker, from %s): %w", fmtBytes(a.Budget), a.BudgetFrom, err)
	}
	a.States = rec.States
	perWorker := eff / world
	for micro := int(rec.Micro); micro >= 1; micro-- {
		if perWorker%micro != 0 {
			continue
		}
		a.Tried = append(a.Tried, micro)
		used, err := probe.at(spec, layout, f, micro)
		if errors.Is(err, memory.ErrOutOfMemory) {
			continue // the device could not hold it: try a smaller one
		}
		if err != nil {
			return nil, fmt.Errorf("train.micro_batch: auto: probing micro-batch %d: %w", micro, err)
		}
		if rec.States+used <= rec.Usable { // conservative: the heap holds a copy of the weights too
			a.Micro, a.Accum, a.Probed = micro, perWorker/micro, used
			cfg.Train.MicroBatch, cfg.Train.Accum = a.Micro, a.Accum
			return a, nil
		}
	}
	return nil, fmt.Errorf("train.micro_batch: auto: no micro-batch dividing %d fits %s of the %s budget per worker (from %s) after the model states (%s); tried %v",
		perWorker, fmtBytes(rec.Usable-rec.States), fmtBytes(a.Budget), a.BudgetFrom, fmtBytes(rec.States), a.Tried)
}

// DataShape is the model's input shape and class count for cfg: the data's (headers and file
// lists only), or, where the data cannot be read, what model.input and model.classes
// declare.
func DataShape(cfg *configs.Config) ([]int, int, error) {
	s, err := data.Describe(cfg.Data)
	if err == nil {
		return s.Input(), s.Classes, nil
	}
	if len(cfg.Model.Input) == 3 && cfg.Model.Classes > 0 {
		return cfg.Model.Input, cfg.Model.Classes, nil
	}
	return nil, 0, fmt.Errorf("the model's input shape and classes come from the data (or from model.input and model.classes): %w", err)
}

// fmtBytes is b in binary units, as qvd estimate prints it.
func fmtBytes(b int64) string { return estimate.FormatBytes(b, false) }

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

func newMicroProbe(cfg *configs.Config, world int, o AutoOptions) (*microProbe, error) {
	if cfg.Engine == configs.EngineGorgonia {
		p := &microProbe{perSample: estimate.MeasureActivationBytes, at: probeMicro, close: func() {}}
		p.budget, p.budgetFrom = o.Budget(cfg, world)
		return p, nil
	}
	dev, err := openDevice(*cfg, nil, cfg.Train.Threads, o.LocalRank)
	if err != nil {
		return nil, err
	}
	alloc := engine.NewAllocator(dev)
	p := &microProbe{close: func() { alloc.Close(); dev.Close() }}
	// The device's memory, shared by the workers that may share it (all of them, at worst,
	// as with qvd launch on one GPU); on the CPU, memory.limit is this worker's own budget;
	// a device that does not say (the CPU backend without memory.limit, the reference) uses
	// the host's figure.
	p.budget = int64(dev.TotalMemory()) / int64(world)
	p.budgetFrom = fmt.Sprintf("the device's %s shared by %d worker(s)", fmtBytes(int64(dev.TotalMemory())), world)
	if !cfg.Device.GPU() {
		p.budget, p.budgetFrom = int64(cfg.Memory.Limit), "memory.limit "+cfg.Memory.Limit.String()
		// memory.limit is only the Go runtime's soft limit: in a container or a job's cgroup
		// with less memory than that, the cgroup's figure is the one that binds.
		if p.budget > 0 {
			if avail, from := o.Budget(cfg, world); avail < p.budget {
				p.budget, p.budgetFrom = avail, from+", below memory.limit "+cfg.Memory.Limit.String()
			}
		}
	}
	if p.budget == 0 {
		p.budget, p.budgetFrom = o.Budget(cfg, world)
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
	b := data.NewBatch(micro, estimate.SampleSize(spec))
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
	return estimate.HeapAfterStep(spec, layout, params, make([]float32, layout.Size), f, micro)
}
