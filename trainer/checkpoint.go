package trainer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
)

// Files inside a checkpoint directory.
const (
	modelFile = "model.safetensors"
	// The optimizer state is saved as shards keyed by flat offset, one per rank, so a later
	// run can re-split it at another world size; one worker writes the single shard 00000.
	optimizerFileFmt = "optimizer-%05d.safetensors"
)

// Meta is the trainer's part of meta.json: everything needed to continue exactly.
type Meta struct {
	Step           int64  `json:"step"`            // global steps completed
	OptimizerSteps int64  `json:"optimizer_steps"` // steps that updated the weights (Adam's t)
	Skipped        int64  `json:"skipped_steps"`
	Epoch          int    `json:"epoch"`        // 0-based epoch in progress
	EpochOffset    int    `json:"epoch_offset"` // samples of that epoch's permutation consumed
	Seed           uint64 `json:"seed"`
	// RNG documents the data-order generator: the epoch permutation is a pure function of
	// (seed, epoch), so (Seed, Epoch, EpochOffset) is its complete state.
	RNG         string       `json:"rng"`
	MicroBatch  int          `json:"micro_batch"`
	Accum       int          `json:"accum"`
	WorldSize   int          `json:"world_size"`
	GlobalBatch int          `json:"global_batch"`
	Precision   string       `json:"precision"`
	Scaler      *ScalerState `json:"loss_scaler,omitempty"`
	Optimizer   string       `json:"optimizer"`
	Model       string       `json:"model"`        // spec summary, e.g. 784-256-128-10
	FlatSize    int          `json:"flat_size"`    // elements of the flat parameter space
	NumParams   int          `json:"num_params"`   // real parameters
	Tensors     []TensorMeta `json:"tensors"`      // the flat layout
	Config      any          `json:"config"`       // the resolved run configuration
	Shards      []ShardMeta  `json:"opt_shards"`   // optimizer state shards by flat offset
	Metrics     EvalSnapshot `json:"last_metrics"` // for humans browsing checkpoints
}

// TensorMeta records one tensor's place in the flat buffer.
type TensorMeta struct {
	Name   string `json:"name"`
	Shape  []int  `json:"shape"`
	Offset int    `json:"offset"`
}

// ShardMeta locates one optimizer-state shard.
type ShardMeta struct {
	File   string `json:"file"`
	Offset int    `json:"offset"`
	Length int    `json:"length"`
}

// EvalSnapshot is informational.
type EvalSnapshot struct {
	LastLoss float64 `json:"last_loss"`
}

func (t *Trainer) meta() Meta {
	m := Meta{
		Step: t.step, OptimizerSteps: t.opt.Steps(), Skipped: t.skipped, Epoch: t.epoch, EpochOffset: t.offset,
		Seed: t.seed, RNG: "pcg(seed, epoch) Fisher-Yates epoch permutation",
		MicroBatch: t.cfg.MicroBatch, Accum: t.cfg.Accum, WorldSize: t.world, GlobalBatch: t.global,
		Precision: t.format.String(), Optimizer: t.optCfg.Type, FlatSize: t.layout.Size, NumParams: t.layout.NumParams(),
		Config: t.snapshot,
		Shards: []ShardMeta{{File: fmt.Sprintf(optimizerFileFmt, 0), Offset: 0, Length: t.layout.Size}},
	}
	if s, ok := t.model.(interface{ Spec() *model.Spec }); ok {
		m.Model = s.Spec().String()
	}
	if t.scaler != nil {
		st := t.scaler.State()
		m.Scaler = &st
	}
	for _, ts := range t.layout.Tensors {
		m.Tensors = append(m.Tensors, TensorMeta{Name: ts.Name, Shape: ts.Shape, Offset: ts.Offset})
	}
	return m
}

// save writes a checkpoint of the state after the last completed step. Every rank calls it;
// rank 0 writes (in a data-parallel group every rank holds the same state) and then tells
// the others whether it succeeded, so a failed save fails every rank instead of leaving the
// others waiting.
func (t *Trainer) save(cctx context.Context) error {
	var werr error
	if t.rank == 0 {
		werr = t.write()
	}
	status := []float64{0}
	if werr != nil {
		status[0] = 1
	}
	if err := t.reduceScalars(cctx, status, collective.Max); err != nil {
		return errors.Join(werr, fmt.Errorf("agreeing on the checkpoint at step %d: %w", t.step, err))
	}
	if werr != nil {
		return werr
	}
	if status[0] != 0 {
		return fmt.Errorf("checkpoint at step %d: %w", t.step, errSaveFailed)
	}
	t.ckptStep = t.step
	return nil
}

// write saves the checkpoint files (rank 0).
func (t *Trainer) write() error {
	tensors := make([]checkpoint.Tensor, len(t.layout.Tensors))
	for i, ts := range t.layout.Tensors {
		buf := make([]float32, ts.Size)
		t.layout.Canonical(buf, t.master, ts)
		tensors[i] = checkpoint.Tensor{Name: ts.Name, Shape: ts.Shape, Data: buf}
	}
	var opt []checkpoint.Tensor
	for _, nb := range t.opt.State() {
		opt = append(opt, checkpoint.Tensor{Name: nb.Name, Shape: []int{len(nb.Data)}, Data: nb.Data})
	}
	optMeta := map[string]string{
		"type": t.optCfg.Type, "offset": "0", "length": strconv.Itoa(t.layout.Size),
		"steps": strconv.FormatInt(t.opt.Steps(), 10),
	}
	files := map[string]func(io.Writer) error{
		modelFile: func(w io.Writer) error {
			return checkpoint.WriteSafetensors(w, tensors, map[string]string{"format": "pt", "producer": "qvd"})
		},
		fmt.Sprintf(optimizerFileFmt, 0): func(w io.Writer) error { return checkpoint.WriteSafetensors(w, opt, optMeta) },
	}
	path, err := t.ckpt.Save(t.step, files, t.meta())
	if err != nil && !errors.Is(err, checkpoint.ErrPrune) {
		return fmt.Errorf("saving checkpoint at step %d: %w", t.step, err)
	}
	if err != nil {
		t.log.Warn("checkpoint saved, but removing old checkpoints failed", zap.Error(err))
	}
	t.lastCkpt = path
	t.log.Info("checkpoint saved", zap.String("path", path), zap.Int64("step", t.step))
	return nil
}

// restore loads weights, optimizer state, loss scaler and data position from c.
func (t *Trainer) restore(c *checkpoint.Checkpoint) error {
	var m Meta
	if err := c.Meta(&m); err != nil {
		return fmt.Errorf("resume from %s: reading meta.json: %w", c.Path(), err)
	}
	if m.Optimizer != t.optCfg.Type {
		return fmt.Errorf("resume from %s: the checkpoint's optimizer is %q but the config says %q; resuming would discard its state",
			c.Path(), m.Optimizer, t.optCfg.Type)
	}
	mf, err := c.Safetensors(modelFile)
	if err != nil {
		return fmt.Errorf("resume from %s: %w", c.Path(), err)
	}
	buf := make([]float32, 0)
	for _, ts := range t.layout.Tensors {
		if cap(buf) < ts.Size {
			buf = make([]float32, ts.Size)
		}
		buf = buf[:ts.Size]
		if err := mf.ReadInto(ts.Name, buf, ts.Shape); err != nil {
			return fmt.Errorf("resume from %s: %s does not fit this model (%v): %w", c.Path(), modelFile, ts.Name, err)
		}
		t.layout.SetCanonical(t.master, buf, ts)
	}
	if len(m.Shards) != 1 || m.Shards[0].Offset != 0 || m.Shards[0].Length != t.layout.Size {
		return fmt.Errorf("resume from %s: optimizer state is split into %d shard(s) of a %d-element space; this run expects one shard of %d",
			c.Path(), len(m.Shards), m.FlatSize, t.layout.Size)
	}
	of, err := c.Safetensors(m.Shards[0].File)
	if err != nil {
		return fmt.Errorf("resume from %s: %w", c.Path(), err)
	}
	for _, nb := range t.opt.State() {
		if err := of.ReadInto(nb.Name, nb.Data, []int{len(nb.Data)}); err != nil {
			return fmt.Errorf("resume from %s: optimizer state %q: %w", c.Path(), nb.Name, err)
		}
	}
	if m.OptimizerSteps < 0 || m.OptimizerSteps > m.Step || m.Skipped < 0 {
		return fmt.Errorf("resume from %s: meta.json counters are inconsistent (optimizer_steps %d, step %d, skipped %d)",
			c.Path(), m.OptimizerSteps, m.Step, m.Skipped)
	}
	t.opt.SetSteps(m.OptimizerSteps)
	if t.scaler != nil && m.Scaler != nil {
		if err := t.scaler.SetState(*m.Scaler); err != nil {
			return fmt.Errorf("resume from %s: %w", c.Path(), err)
		}
	}
	if t.format != half.FP32 {
		t.roundParams()
	}
	if m.Epoch < 0 || m.EpochOffset < 0 || m.EpochOffset > t.train.N || m.Step < 0 {
		return fmt.Errorf("resume from %s: meta.json position (epoch %d, offset %d, step %d) is invalid for a %d-sample training set",
			c.Path(), m.Epoch, m.EpochOffset, m.Step, t.train.N)
	}
	if m.Seed != t.seed {
		t.log.Warn("resuming with a different seed: the data order from here on differs from the original run",
			zap.Uint64("checkpoint_seed", m.Seed), zap.Uint64("seed", t.seed))
	}
	if m.GlobalBatch != t.global {
		t.log.Warn("resuming with a different global batch: continuing from the same sample position",
			zap.Int("checkpoint_global_batch", m.GlobalBatch), zap.Int("global_batch", t.global))
	}
	t.step, t.epoch, t.offset, t.skipped = m.Step, m.Epoch, m.EpochOffset, m.Skipped
	t.lastCkpt, t.ckptStep = c.Path(), m.Step
	t.log.Info("resumed", zap.String("from", c.Path()), zap.Int64("step", t.step), zap.Int("epoch", t.epoch), zap.Int("epoch_offset", t.offset))
	return nil
}
