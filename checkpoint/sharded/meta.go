package sharded

import (
	"fmt"
	"io"
	"strconv"

	"github.com/qvd/qvd/checkpoint"
)

// Files inside a checkpoint directory.
const (
	// ModelFile holds the full fp32 weights in the model's canonical (PyTorch) shapes.
	ModelFile = "model.safetensors"
	// shardFileFmt names the optimizer state shards, one per writing rank, keyed by flat
	// offset so a later run can re-split them at another world size; one worker writes the
	// single shard 00000.
	shardFileFmt = "optimizer-%05d.safetensors"
)

// ShardFile is the name of the optimizer-state shard rank writes.
func ShardFile(rank int) string { return fmt.Sprintf(shardFileFmt, rank) }

// Meta is the trainer's part of meta.json: everything needed to continue exactly. Its JSON
// is the on-disk format: fields may be added, never renamed.
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

// ScalerState is the fp16 loss scaler's whole state (package trainer's Scaler), saved so a
// resumed run scales (and skips) exactly as the uninterrupted one would have.
type ScalerState struct {
	Scale          float64 `json:"scale"`
	GoodSteps      int     `json:"good_steps"`      // clean steps since the last overflow or growth
	HysteresisLeft int     `json:"hysteresis_left"` // overflows still tolerated before backing off
	Overflows      int64   `json:"overflows"`       // total overflowed (skipped) steps
}

// Buffer is one named float32 state buffer of an optimizer (exp_avg, exp_avg_sq, ...), or a
// rank's range of one.
type Buffer struct {
	Name string
	Data []float32
}

// ShardHeader is the safetensors metadata of an optimizer shard: where it sits in the flat
// space and what wrote it.
type ShardHeader struct {
	Optimizer      string // the optimizer type
	Offset, Length int
	Steps          int64 // the optimizer's step count
	Rank, World    int
	Stage          int
}

// WriteShard writes one optimizer shard: its state buffers, float32 whatever the optimizer
// keeps in memory, so that any world size and stage can resume from it.
func WriteShard(w io.Writer, state []Buffer, h ShardHeader) error {
	opt := make([]checkpoint.Tensor, 0, len(state))
	for _, b := range state {
		opt = append(opt, checkpoint.Tensor{Name: b.Name, Shape: []int{len(b.Data)}, Data: b.Data})
	}
	return checkpoint.WriteSafetensors(w, opt, map[string]string{
		"type": h.Optimizer, "offset": strconv.Itoa(h.Offset), "length": strconv.Itoa(h.Length),
		"steps": strconv.FormatInt(h.Steps, 10), "rank": strconv.Itoa(h.Rank),
		"world_size": strconv.Itoa(h.World), "zero_stage": strconv.Itoa(h.Stage),
	})
}

// Plan is how a group's optimizer state is split into shard files. At stage 0 every rank
// holds the same whole state and rank 0 alone writes it; at stages 1-2 every rank with a
// non-empty shard writes its own.
type Plan struct {
	Stage     int
	Trainable int   // elements of the trainable flat space the shards tile
	Bounds    []int // rank r's ZeRO shard is [Bounds[r], Bounds[r+1]); len = world + 1
}

// World is the group size the plan is for.
func (p Plan) World() int { return len(p.Bounds) - 1 }

// Writers are the ranks whose optimizer state goes into the checkpoint, in rank order.
func (p Plan) Writers() []int {
	if p.Stage == 0 {
		return []int{0}
	}
	var rs []int
	for r := 0; r < p.World(); r++ {
		if p.Bounds[r+1] > p.Bounds[r] {
			rs = append(rs, r)
		}
	}
	return rs
}

// Writes reports whether rank writes a shard.
func (p Plan) Writes(rank int) bool {
	for _, r := range p.Writers() {
		if r == rank {
			return true
		}
	}
	return false
}

// Range is the flat range of the state rank writes.
func (p Plan) Range(rank int) (lo, hi int) {
	if p.Stage == 0 {
		return 0, p.Trainable
	}
	return p.Bounds[rank], p.Bounds[rank+1]
}

// Shards is meta.json's shard table for the plan.
func (p Plan) Shards() []ShardMeta {
	var out []ShardMeta
	for _, r := range p.Writers() {
		lo, hi := p.Range(r)
		out = append(out, ShardMeta{File: ShardFile(r), Offset: lo, Length: hi - lo})
	}
	return out
}
