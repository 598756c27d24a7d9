package trainer

import (
	"math"
	"testing"
)

// TestDecide drives the step decision directly, one named case per rule: which steps are
// skipped, the clipping factor, the loss scaler's transitions (with hysteresis) and the
// learning rate.
func TestDecide(t *testing.T) {
	scaler := ScalerConfig{InitialScalePower: 16, Window: 3, Hysteresis: 2, MinScale: 1}
	static := ScalerConfig{LossScale: 128, Window: 3, Hysteresis: 2, MinScale: 1}
	consecutive := scaler
	consecutive.ConsecutiveHysteresis = true
	fp32 := stepPolicy{LR: 0.1, Schedule: DefaultScheduleConfig(), TotalSteps: 100}
	clip := fp32
	clip.MaxGradNorm = 1
	withScaler := func(c ScalerConfig) stepPolicy { p := fp32; p.Scaler = &c; return p }
	warmup := fp32
	warmup.Schedule = ScheduleConfig{Type: ScheduleWarmup, WarmupSteps: 4, WarmupType: "linear"}
	cosine := fp32
	cosine.Schedule = ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 0, WarmupType: "linear", MinRatio: 0}
	s64k := ScalerState{Scale: 65536, HysteresisLeft: 2}
	inf, nan := math.Inf(1), math.NaN()

	for _, c := range []struct {
		name   string
		policy stepPolicy
		stats  stepStats
		state  stepState
		want   stepDecision
	}{
		{"clean step", fp32, stepStats{Ran: 2, LossSum: 3, SumSq: 0.25}, stepState{},
			stepDecision{Action: actApply, Loss: 1.5, Scale: 1, Norm: 0.5, GradScale: 1, LR: 0.1}},
		{"clip inactive below the threshold", clip, stepStats{Ran: 1, LossSum: 1, SumSq: 0.81}, stepState{},
			stepDecision{Action: actApply, Loss: 1, Scale: 1, Norm: 0.9, GradScale: 1, LR: 0.1}},
		{"clip active", clip, stepStats{Ran: 1, LossSum: 1, SumSq: 16}, stepState{},
			stepDecision{Action: actApply, Loss: 1, Scale: 1, Norm: 4, GradScale: 1 / (4 + clipEpsilon), LR: 0.1}},
		{"clip on the unscaled norm", func() stepPolicy { p := withScaler(scaler); p.MaxGradNorm = 1; return p }(),
			stepStats{Ran: 1, LossSum: 1, SumSq: 16 * 65536 * 65536}, stepState{Scaler: s64k},
			stepDecision{Action: actApply, Loss: 1, Scale: 65536, Norm: 4, GradScale: 1.0 / 65536 * (1 / (4 + clipEpsilon)), LR: 0.1,
				Scaler: ScalerState{Scale: 65536, GoodSteps: 1, HysteresisLeft: 2}}},
		{"every micro-batch out of memory", withScaler(scaler), stepStats{Ran: 0, SumSq: 0}, stepState{Scaler: s64k},
			stepDecision{Action: actSkipEmpty, Loss: nan, Scale: 65536, Scaler: s64k}},
		{"non-finite norm without a scaler diverges", fp32, stepStats{Ran: 2, LossSum: 2, SumSq: inf}, stepState{},
			stepDecision{Action: actDiverged, Loss: 1, Scale: 1}},
		{"NaN norm without a scaler diverges", fp32, stepStats{Ran: 2, LossSum: nan, SumSq: nan}, stepState{},
			stepDecision{Action: actDiverged, Loss: nan, Scale: 1}},
		{"overflow within hysteresis keeps the scale", withScaler(scaler), stepStats{Ran: 1, LossSum: 1, SumSq: inf}, stepState{Scaler: s64k},
			stepDecision{Action: actSkipOverflow, Loss: 1, Scale: 65536, Scaler: ScalerState{Scale: 65536, HysteresisLeft: 1, Overflows: 1}}},
		{"overflow past hysteresis halves the scale", withScaler(scaler), stepStats{Ran: 1, LossSum: 1, SumSq: nan},
			stepState{Scaler: ScalerState{Scale: 65536, GoodSteps: 2, HysteresisLeft: 1, Overflows: 1}},
			stepDecision{Action: actSkipOverflow, Loss: 1, Scale: 65536, Scaler: ScalerState{Scale: 32768, HysteresisLeft: 1, Overflows: 2}, ScaleChanged: true}},
		{"overflow at the minimum scale", withScaler(scaler), stepStats{Ran: 1, LossSum: 1, SumSq: inf},
			stepState{Scaler: ScalerState{Scale: 1, HysteresisLeft: 1}},
			stepDecision{Action: actSkipOverflow, Loss: 1, Scale: 1, Scaler: ScalerState{Scale: 1, HysteresisLeft: 1, Overflows: 1}}},
		{"static scale skips and never changes", withScaler(static), stepStats{Ran: 1, LossSum: 1, SumSq: inf},
			stepState{Scaler: ScalerState{Scale: 128, HysteresisLeft: 2}},
			stepDecision{Action: actSkipOverflow, Loss: 1, Scale: 128, Scaler: ScalerState{Scale: 128, HysteresisLeft: 2, Overflows: 1}}},
		{"clean steps grow the scale after the window", withScaler(scaler), stepStats{Ran: 1, LossSum: 1, SumSq: 65536 * 65536},
			stepState{Scaler: ScalerState{Scale: 65536, GoodSteps: 2, HysteresisLeft: 1}},
			stepDecision{Action: actApply, Loss: 1, Scale: 65536, Norm: 1, GradScale: 1.0 / 65536, LR: 0.1,
				Scaler: ScalerState{Scale: 131072, HysteresisLeft: 2}, ScaleChanged: true}},
		{"consecutive hysteresis restores after a clean step", withScaler(consecutive), stepStats{Ran: 1, LossSum: 1, SumSq: 0},
			stepState{Scaler: ScalerState{Scale: 65536, HysteresisLeft: 1}},
			stepDecision{Action: actApply, Loss: 1, Scale: 65536, Norm: 0, GradScale: 1.0 / 65536, LR: 0.1,
				Scaler: ScalerState{Scale: 65536, GoodSteps: 1, HysteresisLeft: 2}}},
		{"warmup LR at the first optimizer step", warmup, stepStats{Ran: 1, LossSum: 1, SumSq: 1}, stepState{OptimizerSteps: 0},
			stepDecision{Action: actApply, Loss: 1, Scale: 1, Norm: 1, GradScale: 1, LR: 0.1 * 0.25}},
		{"warmup LR counts optimizer steps, not skipped ones", warmup, stepStats{Ran: 1, LossSum: 1, SumSq: 1}, stepState{OptimizerSteps: 2},
			stepDecision{Action: actApply, Loss: 1, Scale: 1, Norm: 1, GradScale: 1, LR: 0.1 * 0.75}},
		{"decay LR halfway through the run", cosine, stepStats{Ran: 1, LossSum: 1, SumSq: 1}, stepState{OptimizerSteps: 50},
			stepDecision{Action: actApply, Loss: 1, Scale: 1, Norm: 1, GradScale: 1, LR: 0.1 * 0.5 * (1 + math.Cos(math.Pi*0.5))}},
		{"a non-finite loss with a finite gradient fails after the step", fp32, stepStats{Ran: 1, LossSum: inf, SumSq: 1}, stepState{},
			stepDecision{Action: actApply, Loss: inf, Scale: 1, Norm: 1, GradScale: 1, LR: 0.1, LossDiverged: true}},
		{"a non-finite loss is the scaler's business with fp16", withScaler(scaler), stepStats{Ran: 1, LossSum: inf, SumSq: 1},
			stepState{Scaler: s64k},
			stepDecision{Action: actApply, Loss: inf, Scale: 65536, Norm: 1.0 / 65536, GradScale: 1.0 / 65536, LR: 0.1,
				Scaler: ScalerState{Scale: 65536, GoodSteps: 1, HysteresisLeft: 2}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := c.state
			got := c.policy.decide(c.stats, c.state)
			if !sameDecision(got, c.want) {
				t.Fatalf("decide(%+v, %+v)\n got %+v\nwant %+v", c.stats, c.state, got, c.want)
			}
			if c.state != before {
				t.Fatalf("decide changed its input state: %+v -> %+v", before, c.state)
			}
			if again := c.policy.decide(c.stats, c.state); !sameDecision(again, got) {
				t.Fatalf("decide is not deterministic: %+v then %+v", got, again)
			}
		})
	}
}

// sameDecision compares decisions field by field, NaN equal to NaN and floats to 1e-15.
func sameDecision(a, b stepDecision) bool {
	eq := func(x, y float64) bool {
		if math.IsNaN(x) || math.IsNaN(y) {
			return math.IsNaN(x) && math.IsNaN(y)
		}
		return x == y || math.Abs(x-y) <= 1e-15*math.Max(math.Abs(x), math.Abs(y))
	}
	return a.Action == b.Action && eq(a.Loss, b.Loss) && eq(a.Scale, b.Scale) && eq(a.Norm, b.Norm) &&
		eq(a.GradScale, b.GradScale) && eq(a.LR, b.LR) && a.Scaler == b.Scaler && a.ScaleChanged == b.ScaleChanged &&
		a.LossDiverged == b.LossDiverged
}
