package main

import (
	"context"
	"fmt"
	"os"
	"strconv"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/blas"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/trainer"
)

// localRank is this worker's index on its machine, which picks its GPU: QVD_LOCAL_RANK (set
// by qvd launch), LOCAL_RANK (torchrun's), SLURM_LOCALID, else the global rank.
func localRank(rank int) int {
	for _, k := range []string{"QVD_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID"} {
		if v := os.Getenv(k); v != "" {
			if n, err := strconv.Atoi(v); err == nil && n >= 0 {
				return n
			}
		}
	}
	return rank
}

// worker is the model a worker trains, on the CPU or a GPU, with the rebuild function memory
// adaptation calls, the pool of goroutines that owns the cores (the engine's passes and the
// optimizer's share it), and what must be closed at the end.
type worker struct {
	model   trainer.Model
	rebuild func(micro int) (trainer.Model, error)
	pool    *offload.Pool
	closers []func()
	device  string
}

func (e *worker) Close() {
	for i := len(e.closers) - 1; i >= 0; i-- {
		e.closers[i]()
	}
}

// newEngine builds the model cfg.Engine and cfg.Device select over params.
func newEngine(cfg configs.Config, spec *model.Spec, layout *model.Layout, params []float32, rank int, log *zap.Logger) (*worker, error) {
	e := &worker{}
	threads := cfg.Train.Threads
	if cfg.Optimizer.Threads > 0 {
		threads = cfg.Optimizer.Threads
	}
	e.pool = offload.NewPool(threads)
	e.closers = append(e.closers, func() { e.pool.Close() })
	if cfg.Engine == configs.EngineGorgonia {
		if cfg.Train.Threads > 0 {
			blas.SetThreads(cfg.Train.Threads)
		}
		opts := func(micro int) model.Options {
			return model.Options{MicroBatch: micro, EvalBatch: cfg.Train.EvalBatch, Grad: cfg.Train.Format(),
				Segments: cfg.Model.ActivationCheckpointing.Segments}
		}
		net, err := model.New(spec, layout, params, opts(cfg.Train.MicroBatch))
		if err != nil {
			e.Close()
			return nil, err
		}
		e.model, e.device = net, "cpu (gorgonia engine)"
		e.closers = append(e.closers, func() { net.Close() })
		// The trainer closes the graphs it replaces; the last one is closed here.
		e.rebuild = func(micro int) (trainer.Model, error) {
			n, err := model.New(spec, layout, params, opts(micro))
			if err != nil {
				return nil, err
			}
			e.closers = append(e.closers, func() { n.Close() })
			return n, nil
		}
		return e, nil
	}
	var dev engine.Device
	if cfg.Device.GPU() {
		d, err := engine.Open(cfg.Device, localRank(rank))
		if err != nil {
			e.Close()
			return nil, err
		}
		dev = d
	} else {
		d, err := newCPUDevice(e.pool, 0, uint64(cfg.Memory.Limit))
		if err != nil {
			e.Close()
			return nil, err
		}
		dev = d
	}
	e.closers = append(e.closers, func() { dev.Close() })
	alloc := engine.NewAllocator(dev)
	e.closers = append(e.closers, alloc.Close)
	opts := func(micro int) engine.Options {
		return engine.Options{MicroBatch: micro, EvalBatch: cfg.Train.EvalBatch, Precision: cfg.Train.Format(),
			Segments: cfg.Model.ActivationCheckpointing.Segments}
	}
	net, err := engine.NewNet(alloc, spec, layout, params, opts(cfg.Train.MicroBatch))
	if err != nil {
		e.Close()
		return nil, err
	}
	e.model, e.device = net, dev.Name()
	e.closers = append(e.closers, func() { net.Close() })
	e.rebuild = func(micro int) (trainer.Model, error) {
		n, err := engine.NewNet(alloc, spec, layout, params, opts(micro))
		if err != nil {
			return nil, err
		}
		e.closers = append(e.closers, func() { n.Close() })
		return n, nil
	}
	log.Info("engine", zap.String("device", dev.Name()), zap.Int("local_rank", localRank(rank)),
		zap.String("precision", cfg.Train.Precision))
	return e, nil
}

// newNCCL, set by a binary built with -tags cuda, makes an NCCL communicator for the GPU
// ordinal, bootstrapped (its unique id exchanged) over the gRPC ring.
var newNCCL func(ctx context.Context, bootstrap collective.Communicator, ordinal int) (collective.Communicator, error)

// ncclOver wraps the bootstrap ring for collective.transport: nccl.
func ncclOver(ctx context.Context, ring collective.Communicator, rank int, dcfg engine.Config) (collective.Communicator, error) {
	if newNCCL == nil {
		return nil, fmt.Errorf("collective.transport: nccl: this qvd was built without CUDA support (build it with `go build -tags cuda ./cmd/qvd`; see docs/gpu.md)")
	}
	ord := dcfg.Ordinal
	if ord < 0 {
		ord = localRank(rank) // the same rule as engine.Open; a process sees its GPUs from 0
	}
	return newNCCL(ctx, ring, ord)
}

// stacked is a communicator over another that it was bootstrapped from (NCCL over the gRPC
// ring): closing it closes both.
type stacked struct {
	collective.Communicator
	under collective.Communicator
}

func (s stacked) Close() error {
	err := s.Communicator.Close()
	if e := s.under.Close(); err == nil {
		err = e
	}
	return err
}
