package main

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
	commBytes = 10 << 20
	// faultAround is what one first touch of a mapped file brings into a process's resident
	// set: the kernel maps the neighbouring cached pages too (fault_around_bytes, 64 KiB).
	faultAround = 64 << 10
)

// peakEstimate is the resident memory qvd expects a rank of the native CPU engine to reach.
type peakEstimate struct {
	states, activations, dataset, runtime int64
	micro, evalBatch                      int
}

func (p peakEstimate) total() int64 { return p.states + p.activations + p.dataset + p.runtime }

// estimatePeak adds up one rank's peak resident memory on the CPU engine: the model states
// (the engine's own accounting, exact), the activation workspace (measured: one forward and
// backward pass at the micro-batch and one evaluation pass, on the engine's allocator), the
// dataset pages the run touches, and the runtime.
func estimatePeak(cfg configs.Config, in estimateInput, spec *model.Spec) (peakEstimate, error) {
	p := peakEstimate{micro: cfg.Train.MicroBatch, evalBatch: cfg.Train.EvalBatch}
	if p.micro < 1 {
		return p, fmt.Errorf("train.micro_batch: the peak needs a number (auto is resolved when the job starts)")
	}
	m, err := zero.Estimate(in.spec(in.stage, in.offload, 4))
	if err != nil {
		return p, err
	}
	p.states = m.Total()
	if p.activations, err = measurePeakActivations(spec, in.format(), p.micro, p.evalBatch); err != nil {
		return p, fmt.Errorf("measuring the activations: %w", err)
	}
	if p.dataset, err = datasetResident(cfg, in.world); err != nil {
		return p, err
	}
	p.runtime = runtimeBytes
	if in.world > 1 {
		p.runtime += commBytes
	}
	return p, nil
}

// measurePeakActivations runs the native engine on the CPU backend at the micro-batch and at
// the evaluation batch and returns its allocator's peak: activations and workspace (and, in
// fp16/bf16, the engine's half-precision copy of the weights), the training blocks still
// cached while the evaluation runs, as in a real run.
func measurePeakActivations(spec *model.Spec, f half.Format, micro, evalBatch int) (int64, error) {
	layout := model.NewLayout(spec)
	blk, params, err := arena.Float32s(layout.Size, arena.Params)
	if err != nil {
		return 0, err
	}
	defer blk.Free()
	model.Init(spec, layout, params, 1)
	dev, err := newCPUDevice(nil, 0, 0)
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
	size := 1
	for _, d := range spec.Input {
		size *= d
	}
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

// datasetResident is how much of the dataset a rank's resident set holds by the end of the
// run, from the data's own sizes (data.Count): of mapped images, the training samples it
// reads and its share of the validation and test samples it evaluates, each first touch
// mapping faultAround bytes of the file's cached pages, up to the file's size; images held
// in memory (a subset, data.cache none, safetensors F32) count whole. An image folder's
// samples are decoded per batch and count nothing.
func datasetResident(cfg configs.Config, world int) (int64, error) {
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

func (p peakEstimate) print(w io.Writer, in estimateInput) {
	fmt.Fprintf(w, "\nPeak resident memory per rank, qvd's CPU engine (stage %d%s, micro-batch %d, eval batch %d):\n",
		in.stage, map[bool]string{true: " + offload", false: ""}[in.offload], p.micro, p.evalBatch)
	fmt.Fprintf(w, "  model states  %10s  (the table's qvd CPU engine column)\n", humanBytes(p.states))
	fmt.Fprintf(w, "  activations   %10s  (measured on the engine: one step and one evaluation)\n", humanBytes(p.activations))
	fmt.Fprintf(w, "  dataset       %10s  (the mapped images the run reads)\n", humanBytes(p.dataset))
	fmt.Fprintf(w, "  runtime       %10s  (binary, Go runtime, libraries%s)\n", humanBytes(p.runtime), map[bool]string{true: ", collective buffers", false: ""}[in.world > 1])
	fmt.Fprintf(w, "  total         %10s  (what the kernel's VmHWM should show, within about 15%%)\n", humanBytes(p.total()))
}
