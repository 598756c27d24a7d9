package zero_test

import (
	"errors"
	"testing"

	"github.com/qvd/qvd/zero"
)

// TestRecommend: the recommendation keeps the effective batch exactly, fits the usable budget,
// takes the largest micro-batch that does, and says when nothing fits.
func TestRecommend(t *testing.T) {
	job := zero.Job{Elems: 1_000_000, World: 2, Stage: 2, FP32: false, StateElems: 2, Accum: 1}
	s := job.Spec(2, false, 4)
	const usable, perSample = 80_000_000, 1 << 20
	r, err := zero.Recommend(s, usable, 96, perSample)
	if err != nil {
		t.Fatal(err)
	}
	m, _ := zero.Estimate(s)
	if r.States != m.Total() || r.Micro*r.Accum*2 != 96 || r.States+r.Micro*perSample > usable {
		t.Fatalf("%+v: states %d, want micro × accum × 2 = 96 within %d", r, m.Total(), usable)
	}
	for d := r.Micro + 1; d <= 48; d++ {
		if 48%d == 0 && r.States+d*perSample <= usable {
			t.Fatalf("micro %d fits too, but %d was recommended", d, r.Micro)
		}
	}
	if _, err := zero.Recommend(s, usable, 95, perSample); err == nil {
		t.Error("an effective batch that does not divide among the ranks")
	}
	if _, err := zero.Recommend(s, r.States, 96, perSample); !errors.Is(err, zero.ErrStatesTooLarge) {
		t.Errorf("no room for the states: %v", err)
	}
	if _, err := zero.Recommend(s, r.States+perSample-1, 96, perSample); !errors.Is(err, zero.ErrSampleTooLarge) {
		t.Errorf("no room for a sample: %v", err)
	}
}

// TestJobSpec: a job's spec at any stage takes the reduce bucket the engine resolves.
func TestJobSpec(t *testing.T) {
	j := zero.Job{Elems: 10_000_000, World: 4, StateElems: 2}
	for stage := 0; stage <= 2; stage++ {
		if got, want := j.Spec(stage, true, 2).BucketElems, zero.AutoReduceBucketElems(j.Elems, j.World, stage); got != want {
			t.Errorf("stage %d: auto bucket %d, want %d", stage, got, want)
		}
	}
	j.ReduceBucket = 1 << 40
	if got := j.Spec(0, false, 4).BucketElems; got != j.Elems {
		t.Errorf("bucket larger than the model: %d, want %d", got, j.Elems)
	}
}
