package model

import (
	"errors"

	"github.com/qvd/qvd/internal/half"
)

// Options sizes the two graphs of a Net.
type Options struct {
	MicroBatch int         // samples per ForwardBackward
	EvalBatch  int         // samples per Evaluate call (the last call of a pass may hold fewer)
	Grad       half.Format // working precision gradients are rounded to
	// Segments > 1 turns on activation checkpointing with that many segments (see
	// checkpoint.go); 0 or 1 builds one training graph. At most len(spec.ParamLayers()).
	Segments int
}

// EvalResult sums a forward-only pass over the valid rows of a batch.
type EvalResult struct {
	LossSum float64 // sum over samples of the cross-entropy loss
	Correct int     // samples whose arg-max logit is the label
	N       int     // samples evaluated
}

// ErrBatch reports a batch that does not fit the graph.
var ErrBatch = errors.New("model: batch does not match the graph")
