package model

import (
	"errors"
	"fmt"
	"math"

	"github.com/qvd/qvd/internal/half"
)

// Options sizes the two graphs of a Net.
type Options struct {
	MicroBatch int         // samples per ForwardBackward
	EvalBatch  int         // samples per Evaluate call (the last call of a pass may hold fewer)
	Grad       half.Format // working precision gradients are rounded to
	// Segments > 1 turns on activation checkpointing with that many segments (see
	// recompute.go); 0 or 1 builds one training graph. At most len(spec.ParamLayers()).
	Segments int
}

// EvalResult sums a forward-only pass over the valid rows of a batch.
type EvalResult struct {
	LossSum float64 // sum over samples of the cross-entropy loss
	Correct int     // samples whose arg-max logit is the label
	N       int     // samples evaluated
}

// Score is the evaluation of n samples' logits (n×classes, row-major) against their
// labels: the summed cross-entropy (a log-sum-exp shifted by the row's maximum, in float64)
// and the arg-max hits. Every engine scores its logits with it, so they report alike. A label
// outside [0, classes) is an ErrBatch.
func Score(logits []float32, labels []int32, n, classes int) (EvalResult, error) {
	res := EvalResult{N: n}
	for i := 0; i < n; i++ {
		row := logits[i*classes : (i+1)*classes]
		y := int(labels[i])
		if y < 0 || y >= classes {
			return EvalResult{}, fmt.Errorf("%w: label %d of sample %d outside [0, %d)", ErrBatch, y, i, classes)
		}
		best, m := 0, row[0]
		for c, v := range row {
			if v > m {
				best, m = c, v
			}
		}
		var sum float64
		for _, v := range row {
			sum += math.Exp(float64(v - m))
		}
		res.LossSum += math.Log(sum) - float64(row[y]-m)
		if best == y {
			res.Correct++
		}
	}
	return res, nil
}

// ErrBatch reports a batch that does not fit the graph.
var ErrBatch = errors.New("model: batch does not match the graph")
