package trainer

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/zero"
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
	Model       string       `json:"model"`      // spec summary, e.g. 784-256-128-10
	FlatSize    int          `json:"flat_size"`  // elements of the flat parameter space
	NumParams   int          `json:"num_params"` // real parameters
	Tensors     []TensorMeta `json:"tensors"`    // the flat layout
	Config      any          `json:"config"`     // the resolved run configuration
	Shards      []ShardMeta  `json:"opt_shards"` // optimizer state shards by flat offset
	ZeroStage   int          `json:"zero_stage"` // the stage that wrote it (any stage can resume it)
	// Frozen is the frozen prefix of the flat space; the optimizer shards' offsets count from it.
	Frozen  int          `json:"frozen_elements,omitempty"`
	Metrics EvalSnapshot `json:"last_metrics"` // for humans browsing checkpoints
	// Input and Classes are the sample shape [C, H, W] and the class count the model was
	// trained on, and ClassNames the classes' names where the data names them (an image
	// folder's): what qvd predict sizes the model and names its answers with, without the
	// dataset.
	Input      []int    `json:"input,omitempty"`
	Classes    int      `json:"classes,omitempty"`
	ClassNames []string `json:"class_names,omitempty"`
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
		Step: t.step, OptimizerSteps: t.eng.Optimizer().Steps(), Skipped: t.skipped, Epoch: t.epoch, EpochOffset: t.offset,
		Seed: t.seed, RNG: "pcg(seed, epoch) Fisher-Yates epoch permutation",
		MicroBatch: t.cfg.MicroBatch, Accum: t.cfg.Accum, WorldSize: t.world, GlobalBatch: t.global,
		Precision: t.format.String(), Optimizer: t.optCfg.Type, FlatSize: t.layout.Size, Frozen: t.layout.Frozen, NumParams: t.layout.NumParams(),
		Config: t.snapshot, ZeroStage: t.zeroCfg.Stage,
		Input: []int{t.train.C, t.train.H, t.train.W}, Classes: t.train.Classes, ClassNames: t.train.ClassNames,
	}
	for _, r := range t.shardWriters() {
		lo, hi := t.shardOf(r)
		m.Shards = append(m.Shards, ShardMeta{File: fmt.Sprintf(optimizerFileFmt, r), Offset: lo, Length: hi - lo})
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

// shardWriters are the ranks whose optimizer state goes into the checkpoint: rank 0 alone
// at stage 0 (every rank holds the same state), every rank with a non-empty shard at 1-2.
func (t *Trainer) shardWriters() []int {
	if t.zeroCfg.Stage == 0 {
		return []int{0}
	}
	var rs []int
	for r := 0; r < t.world; r++ {
		if t.eng.Layout().Len(r) > 0 {
			rs = append(rs, r)
		}
	}
	return rs
}

func (t *Trainer) shardOf(r int) (lo, hi int) {
	if t.zeroCfg.Stage == 0 {
		return 0, t.layout.Trainable()
	}
	return t.eng.Layout().Shard(r)
}

// save writes a checkpoint of the state after the last completed step. Every rank calls it:
// rank 0 writes the full model (fp32 master weights, gathered from the shards) and meta.json,
// every rank that owns optimizer state writes its shard keyed by flat offset into the same
// pending directory (so at stages 1-2 checkpoint.dir must be shared by the ranks), and rank 0
// commits once all have succeeded. After each phase the ranks agree on success, so a failed
// save fails every rank together and publishes nothing.
func (t *Trainer) save(cctx context.Context) error {
	if err := t.pullDevice(); err != nil {
		return fmt.Errorf("checkpoint at step %d: %w", t.step, err)
	}
	trainable, err := t.eng.FullMaster(cctx)
	if err != nil {
		return fmt.Errorf("checkpoint at step %d: %w", t.step, err)
	}
	full := trainable
	if f := t.layout.Frozen; f > 0 {
		full = make([]float32, t.layout.Size)
		copy(full[f:], trainable)
		copy(full[:f], t.frozenWeights())
	}
	var p *checkpoint.Pending
	fail := func(err error) error {
		if p != nil {
			if aerr := p.Abort(); aerr != nil {
				t.log.Warn("removing the failed checkpoint's pending directory", zap.Error(aerr))
			}
		}
		return err
	}
	var werr error
	if t.rank == 0 {
		p, werr = t.ckpt.BeginShared(t.step)
	}
	if err := t.agree(cctx, werr, "starting"); err != nil {
		return fail(err)
	}
	lo, hi := t.eng.Shard()
	writesShard := false
	for _, r := range t.shardWriters() {
		writesShard = writesShard || r == t.rank
	}
	shardName := fmt.Sprintf(optimizerFileFmt, t.rank)
	writeShard := func(w io.Writer) error {
		var opt []checkpoint.Tensor
		// float32 whatever the optimizer keeps (the 8-bit ones decode into temporary copies),
		// so that any world size and stage can resume from it.
		for _, nb := range offload.ExportState(t.eng.Optimizer()) {
			opt = append(opt, checkpoint.Tensor{Name: nb.Name, Shape: []int{len(nb.Data)}, Data: nb.Data})
		}
		return checkpoint.WriteSafetensors(w, opt, map[string]string{
			"type": t.optCfg.Type, "offset": strconv.Itoa(lo), "length": strconv.Itoa(hi - lo),
			"steps": strconv.FormatInt(t.eng.Optimizer().Steps(), 10), "rank": strconv.Itoa(t.rank),
			"world_size": strconv.Itoa(t.world), "zero_stage": strconv.Itoa(t.zeroCfg.Stage),
		})
	}
	werr = nil
	switch {
	case t.rank == 0:
		_, werr = p.WriteFile(shardName, writeShard)
		if werr == nil {
			_, werr = p.WriteFile(modelFile, func(w io.Writer) error { return t.writeModel(w, full) })
		}
	case writesShard:
		// Rank 0's Manager read the run id from the same file when the run started; the
		// run directory's lock keeps it unchanged while the run lasts.
		runID, err := checkpoint.ReadRunID(t.ckptCfg.Dir)
		dir := checkpoint.SharedPendingDir(t.ckptCfg.Dir, runID, t.step)
		if err == nil {
			_, err = os.Stat(dir)
		}
		if err != nil {
			werr = fmt.Errorf("rank %d cannot see the checkpoint rank 0 started (%w): at ZeRO stage %d every rank writes its optimizer shard into checkpoint.dir, which must be a filesystem shared by all ranks",
				t.rank, err, t.zeroCfg.Stage)
		} else {
			_, werr = checkpoint.WriteFileIn(dir, shardName, writeShard)
		}
	}
	if werr != nil {
		werr = fmt.Errorf("checkpoint at step %d: %w", t.step, werr)
	}
	if err := t.agree(cctx, werr, "writing"); err != nil {
		return fail(err)
	}
	var path string
	if t.rank == 0 {
		var others []checkpoint.FileInfo
		for _, r := range t.shardWriters() {
			if r == 0 {
				continue
			}
			fi, err := checkpoint.Describe(p.Dir(), fmt.Sprintf(optimizerFileFmt, r))
			if err != nil {
				werr = fmt.Errorf("checkpoint at step %d: the optimizer shard of rank %d: %w", t.step, r, err)
				break
			}
			others = append(others, fi)
		}
		if werr == nil {
			path, werr = p.Commit(t.meta(), others...)
			if errors.Is(werr, checkpoint.ErrPrune) {
				t.log.Warn("checkpoint saved, but removing old checkpoints failed", zap.Error(werr))
				werr = nil
			} else if werr != nil {
				werr = fmt.Errorf("saving checkpoint at step %d: %w", t.step, werr)
			}
		}
	}
	if err := t.agree(cctx, werr, "committing"); err != nil {
		return fail(err)
	}
	if path == "" {
		path = filepath.Join(t.ckptCfg.Dir, checkpoint.StepDirName(t.step))
	}
	t.lastCkpt, t.ckptStep = path, t.step
	if t.rank == 0 {
		t.log.Info("checkpoint saved", zap.String("path", path), zap.Int64("step", t.step), zap.Int("shards", len(t.shardWriters())))
	}
	return nil
}

// agree tells every rank whether any rank failed a phase of a save; it returns this rank's own
// error, or errSaveFailed when only another rank failed.
func (t *Trainer) agree(cctx context.Context, werr error, phase string) error {
	status := []float64{0}
	if werr != nil {
		status[0] = 1
	}
	if err := t.reduceScalars(cctx, status, collective.Max); err != nil {
		return errors.Join(werr, fmt.Errorf("agreeing on the checkpoint at step %d (%s): %w", t.step, phase, err))
	}
	if werr != nil {
		return werr
	}
	if status[0] != 0 {
		return fmt.Errorf("checkpoint at step %d (%s): %w", t.step, phase, errSaveFailed)
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
	var m Meta
	if err := c.Meta(&m); err != nil {
		return fmt.Errorf("resume from %s: reading meta.json: %w", c.Path(), err)
	}
	if m.Optimizer != t.optCfg.Type {
		return fmt.Errorf("resume from %s: the checkpoint's optimizer is %q but the config says %q; resuming would discard its state",
			c.Path(), m.Optimizer, t.optCfg.Type)
	}
	if m.Frozen != t.layout.Frozen {
		return fmt.Errorf("resume from %s: the checkpoint was trained with %d frozen elements, this run freezes %d: the freeze settings must match",
			c.Path(), m.Frozen, t.layout.Frozen)
	}
	if m.FlatSize != t.layout.Size {
		return fmt.Errorf("resume from %s: the checkpoint's flat parameter space has %d elements, this model's %d: it is another model",
			c.Path(), m.FlatSize, t.layout.Size)
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
		t.layout.SetCanonical(t.initial, buf, ts)
	}
	src, err := newResumeSource(c, m.Shards, t.layout.Trainable())
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
	if m.WorldSize != t.world || m.ZeroStage != t.zeroCfg.Stage {
		t.log.Info("resharding the checkpoint's optimizer state",
			zap.Int("checkpoint_world", m.WorldSize), zap.Int("checkpoint_zero_stage", m.ZeroStage), zap.Int("shards", len(m.Shards)),
			zap.Int("world", t.world), zap.Int("zero_stage", t.zeroCfg.Stage))
	}
	t.eng.Optimizer().SetSteps(m.OptimizerSteps)
	t.step, t.epoch, t.offset, t.skipped = m.Step, m.Epoch, m.EpochOffset, m.Skipped
	t.lastCkpt, t.ckptStep = c.Path(), m.Step
	t.resumed = src
	t.log.Info("resumed", zap.String("from", c.Path()), zap.Int64("step", t.step), zap.Int("epoch", t.epoch), zap.Int("epoch_offset", t.offset))
	return nil
}

// resumeSource reads optimizer state out of a checkpoint's shards by flat range, whatever
// world size and stage wrote them. It holds one decoded shard tensor at a time: the restore
// walks the flat space in order, so each is decoded once per state buffer.
type resumeSource struct {
	c      *checkpoint.Checkpoint
	shards []ShardMeta // sorted by offset, tiling [0, size)
	cached struct {
		file, name string
		data       []float32
	}
}

// newResumeSource checks that the shards tile the flat space exactly and are all present.
func newResumeSource(c *checkpoint.Checkpoint, shards []ShardMeta, size int) (*resumeSource, error) {
	s := &resumeSource{c: c, shards: slices.Clone(shards)}
	slices.SortFunc(s.shards, func(a, b ShardMeta) int { return a.Offset - b.Offset })
	at := 0
	for _, sh := range s.shards {
		if sh.Offset != at || sh.Length < 0 {
			return nil, fmt.Errorf("meta.json: optimizer shards do not tile the %d-element flat space (shard %s covers [%d, %d), expected to start at %d)",
				size, sh.File, sh.Offset, sh.Offset+sh.Length, at)
		}
		if _, err := c.FilePath(sh.File); err != nil {
			return nil, fmt.Errorf("optimizer shard %s [%d, %d) is missing: %w", sh.File, sh.Offset, sh.Offset+sh.Length, err)
		}
		at += sh.Length
	}
	if at != size {
		return nil, fmt.Errorf("meta.json: optimizer shards cover [0, %d) of a %d-element flat space", at, size)
	}
	return s, nil
}

// read fills dst with state buffer name over [lo, lo+len(dst)).
func (s *resumeSource) read(name string, lo int, dst []float32) error {
	hi := lo + len(dst)
	for _, sh := range s.shards {
		a, b, ok := zero.Overlap(lo, hi, sh.Offset, sh.Offset+sh.Length)
		if !ok {
			continue
		}
		if s.cached.file != sh.File || s.cached.name != name {
			s.cached.data = nil // let the previous one go before decoding the next
			f, err := s.c.Safetensors(sh.File)
			if err != nil {
				return fmt.Errorf("optimizer shard %s: %w", sh.File, err)
			}
			data := make([]float32, sh.Length)
			if err := f.ReadInto(name, data, []int{sh.Length}); err != nil {
				return fmt.Errorf("optimizer shard %s: state %q: %w", sh.File, name, err)
			}
			s.cached.file, s.cached.name, s.cached.data = sh.File, name, data
		}
		copy(dst[a-lo:b-lo], s.cached.data[a-sh.Offset:b-sh.Offset])
	}
	return nil
}
