package estimate

import (
	"fmt"
	"io"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/zero"
)

// Resident-memory terms of the peak estimate that are not the model's: measured on the
// development machine (docs/memory.md, "What the estimate adds up").
const (
	// runtimeBytes is a qvd worker's resident memory before any model state: the binary's
	// text and data (mapped whole by the kernel's large folios), the Go runtime and heap, the
	// BLAS and C libraries.
	runtimeBytes = 48 << 20
	// commBytes is the collectives' buffers of a worker in a group (chunk buffers, gRPC
	// windows).
	commBytes = 5 << 20
	// faultAround is what one first touch of a mapped file brings into a process's resident
	// set: the kernel maps the neighbouring cached pages too (fault_around_bytes, 64 KiB).
	faultAround = 64 << 10
)

// OpenDevice opens the CPU backend the measurements run on (the caller's: it needs cgo).
type OpenDevice func() (engine.Device, error)

// Peak is the resident memory qvd expects a rank of the native CPU engine to reach.
type Peak struct {
	States, Activations, Dataset, Runtime int64
	Micro, EvalBatch                      int
}

// Total is the sum of the terms.
func (p Peak) Total() int64 { return p.States + p.Activations + p.Dataset + p.Runtime }

// Peak adds up one rank's peak resident memory on the CPU engine for cfg's run of spec: the
// model states (the engine's own accounting, exact), the activation workspace (measured: one
// forward and backward pass at the micro-batch and one evaluation pass, on the engine's
// allocator), the dataset pages the run touches, and the runtime.
func (in Input) Peak(cfg configs.Config, spec *model.Spec, open OpenDevice) (Peak, error) {
	p := Peak{Micro: cfg.Train.MicroBatch, EvalBatch: cfg.Train.EvalBatch}
	if p.Micro < 1 {
		return p, fmt.Errorf("train.micro_batch: the peak needs a number (auto is resolved when the job starts)")
	}
	s, err := in.states()
	if err != nil {
		return p, err
	}
	m, err := zero.Estimate(s)
	if err != nil {
		return p, err
	}
	p.States = m.Total()
	if p.Activations, err = MeasurePeakActivations(open, spec, in.Format, p.Micro, p.EvalBatch); err != nil {
		return p, fmt.Errorf("measuring the activations: %w", err)
	}
	if p.Dataset, err = DatasetResident(cfg, in.World); err != nil {
		return p, err
	}
	p.Runtime = runtimeBytes
	if in.World > 1 {
		p.Runtime += commBytes
	}
	return p, nil
}

// WritePeak prints p's terms and total.
func (in Input) WritePeak(w io.Writer, p Peak) {
	fmt.Fprintf(w, "\nPeak resident memory per rank, qvd's CPU engine (stage %d%s, micro-batch %d, eval batch %d):\n",
		in.Stage, map[bool]string{true: " + offload", false: ""}[in.Offload], p.Micro, p.EvalBatch)
	fmt.Fprintf(w, "  model states  %10s  (the table's qvd CPU engine column)\n", in.Bytes(p.States))
	fmt.Fprintf(w, "  activations   %10s  (measured on the engine: one step and one evaluation)\n", in.Bytes(p.Activations))
	fmt.Fprintf(w, "  dataset       %10s  (the mapped images the run reads)\n", in.Bytes(p.Dataset))
	fmt.Fprintf(w, "  runtime       %10s  (binary, Go runtime, libraries%s)\n", in.Bytes(p.Runtime), map[bool]string{true: ", collective buffers", false: ""}[in.World > 1])
	fmt.Fprintf(w, "  total         %10s  (what the kernel's VmHWM should show, within about 15%%)\n", in.Bytes(p.Total()))
}

// MeasurePeakActivations runs the native engine on the CPU backend at the micro-batch and at
// the evaluation batch and returns its allocator's peak: activations and workspace (and, in
// fp16/bf16, the engine's half-precision copy of the weights), the training blocks still
// cached while the evaluation runs, as in a real run.
func MeasurePeakActivations(open OpenDevice, spec *model.Spec, f half.Format, micro, evalBatch int) (int64, error) {
	layout := model.NewLayout(spec)
	blk, params, err := arena.Float32s(layout.Size, arena.Params)
	if err != nil {
		return 0, err
	}
	defer blk.Free()
	model.Init(spec, layout, params, 1)
	dev, err := open()
	if err != nil {
		return 0, err
	}
	defer dev.Close()
	alloc := engine.NewAllocator(dev)
	defer alloc.Close()
	net, err := engine.NewNet(alloc, spec, layout, params, engine.Options{MicroBatch: micro, EvalBatch: evalBatch, Precision: f})
	if err != nil {
		return 0, err
	}
	defer net.Close()
	size := SampleSize(spec)
	b := data.NewBatch(micro, size)
	b.N = micro
	gblk, grads, err := arena.Float32s(layout.Trainable(), arena.Grads)
	if err != nil {
		return 0, err
	}
	defer gblk.Free()
	if _, err := net.ForwardBackward(b, 1, model.FlatSink(grads)); err != nil {
		return 0, err
	}
	eb := data.NewBatch(evalBatch, size)
	eb.N = evalBatch
	if _, err := net.Evaluate(eb); err != nil {
		return 0, err
	}
	return alloc.Stats().MaxReserved, nil
}

// DatasetResident is how much of the dataset a rank's resident set holds by the end of the
// run, from the data's own sizes (data.Count): of mapped images, the training samples it
// reads and its share of the validation and test samples it evaluates, each first touch
// mapping faultAround bytes of the file's cached pages, up to the file's size; images held
// in memory (a subset, data.cache none, safetensors F32) count whole. An image folder's
// samples are decoded per batch and count nothing.
func DatasetResident(cfg configs.Config, world int) (int64, error) {
	sz, err := data.Count(cfg.Data)
	if err != nil {
		return 0, fmt.Errorf("sizing the dataset: %w", err)
	}
	sample := int64(sz.SampleBytes)
	trainFile := int64(sz.Train+sz.Val) * sample // the validation split is stored with train
	test := int64(sz.Test) * sample
	if !sz.Mapped {
		return trainFile + test, nil
	}
	global := int64(cfg.Train.MicroBatch * cfg.Train.Accum * world)
	steps := int64(cfg.Train.Epochs) * (int64(sz.Train) / max(global, 1))
	if cfg.Train.MaxSteps > 0 {
		steps = min(steps, cfg.Train.MaxSteps)
	}
	read := steps*int64(cfg.Train.MicroBatch*cfg.Train.Accum) + int64(sz.Val)/int64(world) // this rank's samples
	trainRes := min(trainFile, read*faultAround)
	if sz.TestMapped {
		test = min(test, int64(sz.Test)/int64(world)*faultAround)
	}
	return trainRes + test, nil
}
