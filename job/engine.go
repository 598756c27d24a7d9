package job

import (
	"context"
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

// LocalRank is a worker's index on its machine, which picks its GPU: QVD_LOCAL_RANK (set by
// qvd launch), LOCAL_RANK (torchrun's), SLURM_LOCALID, as getenv reports them (nil: none),
// else the global rank.
func LocalRank(getenv func(string) string, rank int) int {
	for _, k := range []string{"QVD_LOCAL_RANK", "LOCAL_RANK", "SLURM_LOCALID"} {
		if v := env(getenv)(k); v != "" {
			if n, err := strconv.Atoi(v); err == nil && n >= 0 {
				return n
			}
		}
	}
	return rank
}

// openDevice is the one place a device is chosen: device.type cpu is the CPU backend
// (CPUDevice, on pool, or its own of threads goroutines when pool is nil, capped at
// memory.limit); every other type is a backend in engine's registry (engine.Register: the
// reference device, and cuda where a binary built with -tags cuda links engine/cuda), opened
// for localRank. The NCCL communicator for a GPU comes with the same build (NCCLOver).
func openDevice(cfg configs.Config, pool *offload.Pool, threads, localRank int) (engine.Device, error) {
	if cfg.Device.GPU() {
		return engine.Open(cfg.Device, localRank)
	}
	return CPUDevice(pool, threads, uint64(cfg.Memory.Limit))
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

// newEngine builds the model cfg.Engine and cfg.Device select over params: the gorgonia
// graphs, or the native engine on the device openDevice picks for localRank.
func newEngine(cfg configs.Config, spec *model.Spec, layout *model.Layout, params []float32, localRank int, log *zap.Logger) (*worker, error) {
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
				Segments: cfg.Model.Recompute.Segments}
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
	dev, err := openDevice(cfg, e.pool, 0, localRank)
	if err != nil {
		e.Close()
		return nil, err
	}
	e.closers = append(e.closers, func() { dev.Close() })
	alloc := engine.NewAllocator(dev)
	e.closers = append(e.closers, alloc.Close)
	opts := func(micro int) engine.Options {
		return engine.Options{MicroBatch: micro, EvalBatch: cfg.Train.EvalBatch, Precision: cfg.Train.Format(),
			Segments: cfg.Model.Recompute.Segments}
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
	log.Info("engine", zap.String("device", dev.Name()), zap.Int("local_rank", localRank),
		zap.String("precision", cfg.Train.Precision))
	return e, nil
}

// NCCLOver makes the NCCL communicator for collective.transport: nccl over ring, the gRPC
// ring that bootstraps it (exchanges its unique id), on the GPU dcfg selects for localRank.
// Closing it closes the ring too. A binary built without -tags cuda fails here.
func NCCLOver(ctx context.Context, ring collective.Communicator, localRank int, dcfg engine.Config) (collective.Communicator, error) {
	ord := dcfg.Ordinal
	if ord < 0 {
		ord = localRank // the same rule as engine.Open; a process sees its GPUs from 0
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
