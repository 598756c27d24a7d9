package zero

import (
	"errors"
	"fmt"
)

// Job is what a memory estimate knows of a training job: enough to give the Spec of any
// stage and offload choice, so a table can compare them and a recommendation use the job's.
type Job struct {
	Elems, World int  // flat parameter space Ψ (with alignment padding), ranks
	Stage        int  // the job's ZeRO stage
	Offload      bool // the job's offload_optimizer
	FP32         bool // the working precision is fp32
	StateElems   int  // optimizer state per parameter (optim.StateElems)
	Quantized    bool // the state is block-wise 8-bit (optim.QuantizedState)
	// ReduceBucket is zero_optimization.reduce_bucket_size; 0 sizes it as the engine does
	// (Config.ResolveBuckets).
	ReduceBucket int64
	Accum        int // micro-batches per step (0 counts as 1)
}

// Spec is j's model states at stage and offload with elemBytes-byte working elements (4 for
// the CPU engine, which stores every format as float32).
func (j Job) Spec(stage int, offload bool, elemBytes int) Spec {
	bucket, _ := Config{Stage: stage, ReduceBucketSize: j.ReduceBucket}.ResolveBuckets(j.Elems, j.World)
	return Spec{Elems: j.Elems, World: j.World, Stage: stage, Offload: offload, ElemBytes: elemBytes,
		FP32: j.FP32, StateElems: j.StateElems, Quantized: j.Quantized, BucketElems: bucket, Accum: j.Accum}
}

// Recommendation is a micro-batch and accumulation for a memory budget.
type Recommendation struct {
	States   int64 // the model states (Estimate)
	Usable   int64 // the budget less the caller's headroom
	MaxMicro int64 // samples whose activations fit beside the states
	Micro    int64
	Accum    int64
}

var (
	// ErrStatesTooLarge: the model states alone exceed the usable budget.
	ErrStatesTooLarge = errors.New("zero: the model states alone exceed the budget")
	// ErrSampleTooLarge: not one sample's activations fit beside the model states.
	ErrSampleTooLarge = errors.New("zero: one sample's activations do not fit beside the model states")
)

// Recommend picks the largest micro-batch whose activations (perSample bytes each) fit in
// usable bytes beside s's model states and that divides the per-rank batch, so that micro ×
// accum × world is the effective batch exactly. usable is the budget less the headroom the
// caller keeps for what the states and activations do not include (memory.Headroom). With
// ErrStatesTooLarge or ErrSampleTooLarge the returned figures say by how much.
func Recommend(s Spec, usable, effective, perSample int64) (Recommendation, error) {
	r := Recommendation{Usable: usable}
	if effective%int64(s.World) != 0 {
		return r, fmt.Errorf("the effective batch %d is not a multiple of the world size %d", effective, s.World)
	}
	m, err := Estimate(s)
	if err != nil {
		return r, err
	}
	r.States = m.Total()
	if r.Usable <= r.States {
		return r, ErrStatesTooLarge
	}
	r.MaxMicro = (r.Usable - r.States) / perSample
	if r.MaxMicro < 1 {
		return r, ErrSampleTooLarge
	}
	perRank := effective / int64(s.World)
	for d := min(perRank, r.MaxMicro); d >= 1; d-- {
		if perRank%d == 0 {
			r.Micro, r.Accum = d, perRank/d
			break
		}
	}
	return r, nil
}
