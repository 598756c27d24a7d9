package trainer

import (
	"context"
	"fmt"
	"io"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/checkpoint/sharded"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/optim"
)

// shardPlan is how this group's optimizer state goes into shard files.
func (t *Trainer) shardPlan() sharded.Plan {
	return sharded.Plan{Stage: t.spec.zero.Stage, Trainable: t.layout.Trainable(), Bounds: t.eng.Layout().Shards}
}

func (t *Trainer) meta() sharded.Meta {
	m := sharded.Meta{
		Step: t.pos.step, OptimizerSteps: t.eng.Optimizer().Steps(), Skipped: t.pos.skipped, Epoch: t.pos.epoch, EpochOffset: t.pos.offset,
		Seed: t.spec.seed, RNG: "pcg(seed, epoch) Fisher-Yates epoch permutation",
		MicroBatch: t.cfg.MicroBatch, Accum: t.cfg.Accum, WorldSize: t.group.world, GlobalBatch: t.spec.global,
		Precision: t.spec.format.String(), Optimizer: t.spec.opt.Type, FlatSize: t.layout.Size, Frozen: t.layout.Frozen, NumParams: t.layout.NumParams(),
		Config: t.spec.snapshot, ZeroStage: t.spec.zero.Stage,
		Input: []int{t.data.train.C, t.data.train.H, t.data.train.W}, Classes: t.data.train.Classes, ClassNames: t.data.train.ClassNames,
	}
	m.Shards = t.shardPlan().Shards()
	if s, ok := t.model.(interface{ Spec() *model.Spec }); ok {
		m.Model = s.Spec().String()
	}
	if t.scaler != nil {
		st := t.scaler.State()
		m.Scaler = &st
	}
	for _, ts := range t.layout.Tensors {
		m.Tensors = append(m.Tensors, sharded.TensorMeta{Name: ts.Name, Shape: ts.Shape, Offset: ts.Offset})
	}
	return m
}

// save writes a checkpoint of the state after the last completed step: the full model
// (fp32 master weights, gathered from the shards), meta.json and the optimizer shards, by
// package sharded's protocol. Every rank calls it; a failed save fails every rank together
// and publishes nothing.
func (t *Trainer) save(cctx context.Context) error {
	if err := t.stepper.PullState(); err != nil {
		return fmt.Errorf("checkpoint at step %d: %w", t.pos.step, err)
	}
	trainable, err := t.eng.FullMaster(cctx)
	if err != nil {
		return fmt.Errorf("checkpoint at step %d: %w", t.pos.step, err)
	}
	full := trainable
	if f := t.layout.Frozen; f > 0 {
		full = make([]float32, t.layout.Size)
		copy(full[f:], trainable)
		copy(full[:f], t.frozenWeights())
	}
	plan := t.shardPlan()
	lo, hi := t.eng.Shard()
	s := sharded.Save{
		Step: t.pos.step, Dir: t.ckpt.cfg.Dir, Plan: plan, Manager: t.ckpt.mgr, Log: t.log,
		WriteShard: func(w io.Writer) error {
			// float32 whatever the optimizer keeps (the 8-bit ones decode into temporary
			// copies), so that any world size and stage can resume from it.
			var state []sharded.Buffer
			for _, nb := range optim.ExportState(t.eng.Optimizer()) {
				state = append(state, sharded.Buffer{Name: nb.Name, Data: nb.Data})
			}
			return sharded.WriteShard(w, state, sharded.ShardHeader{
				Optimizer: t.spec.opt.Type, Offset: lo, Length: hi - lo, Steps: t.eng.Optimizer().Steps(),
				Rank: t.group.rank, World: t.group.world, Stage: t.spec.zero.Stage,
			})
		},
		WriteModel: func(w io.Writer) error { return t.writeModel(w, full) },
		Meta:       t.meta,
	}
	path, err := s.Run(cctx, t.group.communicator())
	if err != nil {
		return err
	}
	t.ckpt.last, t.ckpt.step = path, t.pos.step
	if t.group.rank == 0 {
		t.log.Info("checkpoint saved", zap.String("path", path), zap.Int64("step", t.pos.step), zap.Int("shards", len(plan.Writers())))
	}
	return nil
}

// writeModel writes the full fp32 weights in the model's canonical (PyTorch) shapes.
func (t *Trainer) writeModel(w io.Writer, full []float32) error {
	// Tensors stored in their canonical order are written from the flat buffer itself, the
	// transposed ones converted a piece at a time: no copy of the model is made.
	tensors := make([]checkpoint.Tensor, len(t.layout.Tensors))
	for i, ts := range t.layout.Tensors {
		tensors[i] = checkpoint.Tensor{Name: ts.Name, Shape: ts.Shape}
		if ts.Transposed {
			tensors[i].Fill = func(dst []float32, off int) { t.layout.CanonicalAt(dst, full, ts, off) }
		} else {
			tensors[i].Data = full[ts.Offset : ts.Offset+ts.Size]
		}
	}
	return checkpoint.WriteSafetensors(w, tensors, map[string]string{"format": "pt", "producer": "qvd"})
}

// restore reads a checkpoint on rank 0: the position, the loss scaler and the full fp32
// weights now; the optimizer state is streamed from it when Run starts (loadOptimizerState),
// so every rank of any world size and stage gets its shard.
func (t *Trainer) restore(c *checkpoint.Checkpoint) error {
	var m sharded.Meta
	if err := c.Meta(&m); err != nil {
		return fmt.Errorf("resume from %s: reading meta.json: %w", c.Path(), err)
	}
	if m.Optimizer != t.spec.opt.Type {
		return fmt.Errorf("resume from %s: the checkpoint's optimizer is %q but the config says %q; resuming would discard its state",
			c.Path(), m.Optimizer, t.spec.opt.Type)
	}
	if m.Frozen != t.layout.Frozen {
		return fmt.Errorf("resume from %s: the checkpoint was trained with %d frozen elements, this run freezes %d: the freeze settings must match",
			c.Path(), m.Frozen, t.layout.Frozen)
	}
	if m.FlatSize != t.layout.Size {
		return fmt.Errorf("resume from %s: the checkpoint's flat parameter space has %d elements, this model's %d: it is another model",
			c.Path(), m.FlatSize, t.layout.Size)
	}
	mf, err := c.Safetensors(sharded.ModelFile)
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
			return fmt.Errorf("resume from %s: %s does not fit this model (%v): %w", c.Path(), sharded.ModelFile, ts.Name, err)
		}
		t.layout.SetCanonical(t.w.initial, buf, ts)
	}
	src, err := sharded.NewSource(c, m.Shards, t.layout.Trainable())
	if err != nil {
		return fmt.Errorf("resume from %s: %w", c.Path(), err)
	}
	if m.OptimizerSteps < 0 || m.OptimizerSteps > m.Step || m.Skipped < 0 {
		return fmt.Errorf("resume from %s: meta.json counters are inconsistent (optimizer_steps %d, step %d, skipped %d)",
			c.Path(), m.OptimizerSteps, m.Step, m.Skipped)
	}
	if t.scaler != nil && m.Scaler != nil {
		if err := t.scaler.SetState(*m.Scaler); err != nil {
			return fmt.Errorf("resume from %s: %w", c.Path(), err)
		}
	}
	if m.Epoch < 0 || m.EpochOffset < 0 || m.EpochOffset > t.data.train.N || m.Step < 0 {
		return fmt.Errorf("resume from %s: meta.json position (epoch %d, offset %d, step %d) is invalid for a %d-sample training set",
			c.Path(), m.Epoch, m.EpochOffset, m.Step, t.data.train.N)
	}
	if m.Seed != t.spec.seed {
		t.log.Warn("resuming with a different seed: the data order from here on differs from the original run",
			zap.Uint64("checkpoint_seed", m.Seed), zap.Uint64("seed", t.spec.seed))
	}
	if m.GlobalBatch != t.spec.global {
		t.log.Warn("resuming with a different global batch: continuing from the same sample position",
			zap.Int("checkpoint_global_batch", m.GlobalBatch), zap.Int("global_batch", t.spec.global))
	}
	if m.WorldSize != t.group.world || m.ZeroStage != t.spec.zero.Stage {
		t.log.Info("resharding the checkpoint's optimizer state",
			zap.Int("checkpoint_world", m.WorldSize), zap.Int("checkpoint_zero_stage", m.ZeroStage), zap.Int("shards", len(m.Shards)),
			zap.Int("world", t.group.world), zap.Int("zero_stage", t.spec.zero.Stage))
	}
	t.eng.Optimizer().SetSteps(m.OptimizerSteps)
	t.pos.step, t.pos.epoch, t.pos.offset, t.pos.skipped = m.Step, m.Epoch, m.EpochOffset, m.Skipped
	t.ckpt.last, t.ckpt.step = c.Path(), m.Step
	t.ckpt.resumed = src
	t.log.Info("resumed", zap.String("from", c.Path()), zap.Int64("step", t.pos.step), zap.Int("epoch", t.pos.epoch), zap.Int("epoch_offset", t.pos.offset))
	return nil
}
