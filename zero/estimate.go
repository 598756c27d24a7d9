package zero

import (
	"errors"
	"fmt"

	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/optim"
)

// Spec describes one rank's model states for Estimate.
type Spec struct {
	Elems   int  // elements of the flat parameter space (Ψ, with the layout's alignment padding)
	World   int  // ranks
	Stage   int  // ZeRO stage
	Offload bool // optimizer state and step in host memory
	// ElemBytes is the storage size of a working-precision element: 2 for fp16/bf16 and 4
	// for fp32 on a GPU; the CPU engine stores every format in float32 (4).
	ElemBytes int
	// FP32 says the working precision is fp32, so the parameters are the master weights
	// (no separate master copy unless offloaded).
	FP32 bool
	// StateElems is the optimizer's state per parameter: 2 for Adam/AdamW (exp_avg,
	// exp_avg_sq) and their 8-bit versions, 1 for SGD with momentum, 0 for plain SGD.
	StateElems int
	// Quantized says the state is block-wise 8-bit (adam8bit, adamw8bit): a byte per element
	// and a float32 scale per optim.QuantBlock elements of each buffer, instead of float32.
	Quantized bool
	// BucketElems is the reduce bucket size (a partitioned gradient stages two buckets on
	// the device).
	BucketElems int
	// Accum is the micro-batches per step: at stage 1 it decides whether the gradient is
	// partitioned (GradPartitioned; 0 counts as 1).
	Accum int
}

// Validate checks the spec.
func (s Spec) Validate() error {
	switch {
	case s.Elems < 0:
		return fmt.Errorf("parameters must be >= 0, got %d", s.Elems)
	case s.World < 1:
		return fmt.Errorf("world size must be >= 1, got %d", s.World)
	case s.Stage < 0 || s.Stage > 2:
		return fmt.Errorf("stage must be 0, 1 or 2, got %d", s.Stage)
	case s.ElemBytes != 2 && s.ElemBytes != 4:
		return fmt.Errorf("element size must be 2 or 4 bytes, got %d", s.ElemBytes)
	case s.StateElems < 0:
		return errors.New("optimizer state per parameter must be >= 0")
	case GradPartitioned(s.Stage, s.Accum) && s.BucketElems < 1:
		return fmt.Errorf("reduce bucket size must be >= 1 element when the gradient is partitioned, got %d", s.BucketElems)
	}
	return nil
}

// Estimate returns the model-state memory of the rank that holds the most (the largest
// shard), by the same accounting as Engine.Memory: with ElemBytes 4 it is what the CPU engine
// allocates, byte for byte; with ElemBytes 2 and Adam it is the ZeRO paper's 2Ψ + 2Ψ + 12Ψ
// split by stage (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N), plus the staging buffers the paper leaves out.
func Estimate(s Spec) (memory.States, error) {
	if err := s.Validate(); err != nil {
		return memory.States{}, err
	}
	l, err := NewLayout(s.Elems, s.World)
	if err != nil {
		return memory.States{}, err
	}
	n := int64(s.Elems)
	shard := n
	if s.Stage >= 1 {
		shard = int64(l.MaxLen())
	}
	b := int64(s.ElemBytes)
	const f32 = 4
	var m memory.States
	m.Device.Params = b * n
	side := &m.Device
	if s.Offload {
		side = &m.Host
	}
	part := GradPartitioned(s.Stage, s.Accum)
	switch {
	case !part:
		m.Device.Grads = b * n
		if s.Offload {
			m.Host.Grads = f32 * shard // the host copy of the reduced shard
		}
	case s.Offload:
		m.Host.Grads = f32 * shard // accumulated in fp32 on the host
	default:
		m.Device.Grads = b * shard // accumulated in the working precision
	}
	if part {
		// Two staging buckets: the backward pass writes one while the other is on the wire.
		m.Device.Buffers = 2 * b * min(int64(s.BucketElems), n)
	}
	if !s.FP32 || s.Offload {
		side.Master = f32 * shard
	}
	side.Optimizer = f32 * int64(s.StateElems) * shard
	if s.Quantized {
		side.Optimizer = optim.QuantizedStateBytes(s.StateElems, shard)
	}
	if s.Offload && !s.FP32 {
		m.Host.Buffers = b * shard // the updated shard rounded before it is copied back
	}
	return m, nil
}

// PaperFormula is the ZeRO paper's per-rank model-state formula for a stage, with K = 12
// bytes of fp32 master weights and Adam moments per parameter (mixed-precision Adam). Its
// stage 1 keeps the whole gradient, as qvd's does with accumulation.
func PaperFormula(stage int, offload bool) string {
	switch {
	case offload && stage == 2:
		return "2Ψ device + 16Ψ/N host"
	case offload && stage == 0:
		return "4Ψ device + 16Ψ host"
	case offload:
		return "4Ψ device + 16Ψ/N host"
	case stage == 0:
		return "16Ψ"
	case stage == 1:
		return "4Ψ + 12Ψ/N"
	default:
		return "2Ψ + 14Ψ/N"
	}
}
