package trainer

import (
	"math"
)

// The decisions of a step — skip it or apply it, the clipping factor, the loss scaler's next
// state, the learning rate — are a pure function of the step's statistics, reduced across
// the group, and the state before the step: every rank computes the same decision from the
// same inputs, and the tests drive it directly (decide_test.go), as etcd raft's tests drive
// its state machine.

// stepStats are what a step produced, reduced across the group (identical on every rank).
type stepStats struct {
	Ran     int     // micro-batches that ran, over all ranks
	LossSum float64 // the sum of their mean losses
	SumSq   float64 // Σ g² of the reduced gradient, loss scale included; non-finite on overflow
}

// stepPolicy is what decides a step, fixed for the run.
type stepPolicy struct {
	MaxGradNorm float64 // 0: no clipping
	LR          float64 // the optimizer's base learning rate
	Schedule    ScheduleConfig
	TotalSteps  int64         // the run's length, for the schedule's decay
	Scaler      *ScalerConfig // nil: no loss scaling (fp32, bf16)
}

// stepState is the state a step starts from.
type stepState struct {
	Scaler         ScalerState // the loss scaler's (unused without one)
	OptimizerSteps int64       // steps that updated the weights so far
}

// stepAction is what to do with the step's gradient.
type stepAction uint8

const (
	actApply        stepAction = iota // the optimizer steps
	actSkipEmpty                      // every micro-batch of every rank ran out of memory: no gradient
	actSkipOverflow                   // fp16 overflow: skipped, the scaler backs off
	actDiverged                       // a non-finite gradient without a loss scaler: the run fails
)

func (a stepAction) String() string {
	switch a {
	case actApply:
		return "apply"
	case actSkipEmpty:
		return "skip-empty"
	case actSkipOverflow:
		return "skip-overflow"
	case actDiverged:
		return "diverged"
	}
	return "stepAction(?)"
}

// stepDecision is what decide concludes.
type stepDecision struct {
	Action stepAction
	Loss   float64 // the mean loss over the micro-batches that ran (NaN with none)
	Scale  float64 // the loss scale the step ran with (1 without a scaler)
	// Norm is the gradient's global L2 norm, unscaled, GradScale what the optimizer
	// multiplies the gradient by (1/scale × the clipping factor) and LR its learning rate
	// (set with actApply).
	Norm, GradScale, LR float64
	// Scaler is the loss scaler's state after the step, ScaleChanged whether its scale moved.
	Scaler       ScalerState
	ScaleChanged bool
	// LossDiverged: the mean loss is not finite without a loss scaler to explain it; the run
	// fails after the step is applied.
	LossDiverged bool
}

// clipEpsilon keeps the clipping factor finite (torch.nn.utils.clip_grad_norm_'s 1e-6).
const clipEpsilon = 1e-6

// decide is one step's decision.
func (p stepPolicy) decide(st stepStats, s stepState) stepDecision {
	d := stepDecision{Loss: math.NaN(), Scale: p.scale(s), Scaler: s.Scaler}
	if st.Ran > 0 {
		d.Loss = st.LossSum / float64(st.Ran) // mean over the micro-batches that ran, on all ranks
	}
	// One pass gives both the norm and the overflow check: any Inf/NaN makes the sum
	// non-finite.
	overflow := math.IsNaN(st.SumSq) || math.IsInf(st.SumSq, 0)
	switch {
	case st.Ran == 0:
		d.Action = actSkipEmpty
		return d
	case overflow && p.Scaler == nil:
		d.Action = actDiverged
		return d
	case overflow:
		d.Action = actSkipOverflow
		d.Scaler, d.ScaleChanged = p.updateScaler(s.Scaler, true)
		return d
	}
	d.Action = actApply
	d.Norm = math.Sqrt(st.SumSq) / d.Scale
	d.GradScale = 1 / d.Scale
	if p.MaxGradNorm > 0 && d.Norm > p.MaxGradNorm {
		d.GradScale *= p.MaxGradNorm / (d.Norm + clipEpsilon)
	}
	d.LR = p.LR * p.Schedule.Factor(s.OptimizerSteps, p.TotalSteps)
	if p.Scaler != nil {
		d.Scaler, d.ScaleChanged = p.updateScaler(s.Scaler, false)
	}
	d.LossDiverged = p.Scaler == nil && (math.IsNaN(d.Loss) || math.IsInf(d.Loss, 0))
	return d
}

// scale is the loss scale a step starting from s runs with.
func (p stepPolicy) scale(s stepState) float64 {
	if p.Scaler == nil {
		return 1
	}
	return s.Scaler.Scale
}

// updateScaler is the scaler's transition from st on one step's overflow flag.
func (p stepPolicy) updateScaler(st ScalerState, overflow bool) (ScalerState, bool) {
	s := Scaler{cfg: *p.Scaler, st: st}
	_, changed := s.Update(overflow)
	return s.State(), changed
}
