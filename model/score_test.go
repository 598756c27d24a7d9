package model

import (
	"errors"
	"math"
	"testing"
)

// TestScore: the loss is the cross-entropy of the softmax, hits are arg-max matches, and a
// label outside the classes is an ErrBatch.
func TestScore(t *testing.T) {
	logits := []float32{
		1, 2, 3, // label 2: a hit
		5, 0, 0, // label 1: a miss
	}
	r, err := Score(logits, []int32{2, 1}, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	ce := func(row []float64, y int) float64 {
		var s float64
		for _, v := range row {
			s += math.Exp(v)
		}
		return math.Log(s) - row[y]
	}
	want := ce([]float64{1, 2, 3}, 2) + ce([]float64{5, 0, 0}, 1)
	if r.N != 2 || r.Correct != 1 || math.Abs(r.LossSum-want) > 1e-9 {
		t.Fatalf("Score = %+v, want N 2, Correct 1, LossSum %.9f", r, want)
	}
	// Large logits do not overflow: the maximum is taken out first.
	if r, err := Score([]float32{1000, 1000}, []int32{0}, 1, 2); err != nil || math.Abs(r.LossSum-math.Ln2) > 1e-9 {
		t.Fatalf("Score of equal large logits = %+v, %v; want loss ln 2", r, err)
	}
	if _, err := Score(logits, []int32{2, 3}, 2, 3); !errors.Is(err, ErrBatch) {
		t.Fatalf("label 3 of 3 classes: %v, want ErrBatch", err)
	}
}
