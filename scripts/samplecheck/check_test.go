package main

import (
	"strings"
	"testing"
)

// The test run: 8 samples, global batch 4, so 2 steps per epoch; epoch e visits the samples
// in its own order.
const (
	testGlobal = 4
	testSteps  = 2
)

func perm(epoch int) []int32 {
	p := make([]int32, testGlobal*testSteps)
	for i := range p {
		p[i] = int32((i*3 + epoch) % len(p)) // 3 is prime to 8: a permutation
	}
	return p
}

// step is the lines of one step trained by gen at world: the global batch split among the
// ranks as evenly as it goes, one micro-batch each.
func step(gen uint64, world int, st int64) []Line {
	e := int((st - 1) / testSteps)
	off := int((st-1)%testSteps) * testGlobal
	p := perm(e)
	var ls []Line
	for r := range world {
		lo, hi := off+r*testGlobal/world, off+(r+1)*testGlobal/world
		ls = append(ls, Line{Gen: gen, Step: st, Epoch: e, Rank: r, World: world, Idx: append([]int32(nil), p[lo:hi]...)})
	}
	return ls
}

func steps(gen uint64, world int, from, to int64) []Line {
	var ls []Line
	for st := from; st <= to; st++ {
		ls = append(ls, step(gen, world, st)...)
	}
	return ls
}

func join(parts ...[]Line) []Line {
	var all []Line
	for _, p := range parts {
		all = append(all, p...)
	}
	return all
}

func TestCheck(t *testing.T) {
	dup := steps(1, 2, 1, 4)
	dup[2].Idx = append([]int32(nil), dup[0].Idx...) // step 2 rank 0 retrains step 1's samples
	for _, c := range []struct {
		name  string
		lines []Line
		want  Want
		// problems, each a substring of one reported problem; none: the run is clean
		problems []string
		dups     int
		lost     int
	}{
		{name: "clean", lines: steps(1, 2, 1, 4), want: Want{Epochs: 2, TrainSize: 8}},
		{name: "rolled back and re-formed smaller", lines: join(steps(1, 4, 1, 3), steps(2, 3, 2, 4))},
		{name: "grown, no rollback", lines: join(steps(1, 2, 1, 2), steps(2, 4, 3, 4))},
		{name: "a rank's micro-batch lost", lines: join(steps(1, 2, 1, 2), step(1, 2, 3)[:1], steps(1, 2, 4, 4)),
			problems: []string{"step 3 (gen 1): 1 of world 2 ranks", "step 3 (gen 1, world 2): 2 samples, want the global batch 4", "epoch 1: 6 distinct samples, want 2 steps × 4 = 8"}, lost: 2},
		{name: "retrained under a later gen only in part", lines: join(steps(1, 2, 1, 4), step(2, 2, 4)[1:]),
			problems: []string{"step 4 (gen 2): 1 of world 2 ranks", "epoch 1: 6 distinct samples"}, lost: 2},
		{name: "a step missing", lines: join(steps(1, 2, 1, 2), steps(1, 2, 4, 4)),
			problems: []string{"steps 3 to 3 are missing", "epoch 1 has 1 steps, want 2", "epoch 1: 4 distinct samples"}, lost: 4},
		{name: "a sample twice", lines: dup, problems: []string{"epoch 0: 2 samples trained more than once", "epoch 0: 6 distinct samples"}, dups: 2, lost: 2},
		{name: "a micro-batch logged twice in one gen", lines: join(steps(1, 2, 1, 4), step(1, 2, 4)[:1]),
			problems: []string{"step 4 (gen 1): rank 0 logged micro-batch 0 twice", "epoch 1: 2 samples trained more than once"}, dups: 2},
		{name: "an epoch short", lines: steps(1, 2, 1, 3), want: Want{Epochs: 2}, problems: []string{"epoch 1 has 1 steps, want 2"}, lost: 4},
		{name: "epochs wanted", lines: steps(1, 2, 1, 4), want: Want{Epochs: 3}, problems: []string{"2 epochs logged, want 3"}},
		{name: "outside the training set", lines: steps(1, 2, 1, 4), want: Want{TrainSize: 7}, problems: []string{"sample 7 outside the training set [0, 7)"}},
		{name: "global batch wanted", lines: steps(1, 2, 1, 4), want: Want{GlobalBatch: 8}, problems: []string{"step 1 (gen 1, world 2): 4 samples, want the global batch 8"}, lost: 16},
		{name: "empty", problems: []string{"no sample lines"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := Check(c.lines, c.want)
			if len(c.problems) == 0 && len(s.Problems) > 0 {
				t.Fatalf("problems in a clean run:\n%s", s)
			}
			for _, p := range c.problems {
				found := false
				for _, got := range s.Problems {
					found = found || strings.Contains(got, p)
				}
				if !found {
					t.Errorf("no problem %q in:\n%s", p, s)
				}
			}
			if s.Duplicates != c.dups || s.Lost != c.lost {
				t.Errorf("duplicates %d lost %d, want %d and %d:\n%s", s.Duplicates, s.Lost, c.dups, c.lost, s)
			}
		})
	}
}

// TestCheckSummary: the counts of a re-formed run: the superseded lines are those of the steps
// the later gen trained again.
func TestCheckSummary(t *testing.T) {
	s := Check(join(steps(1, 4, 1, 3), steps(2, 3, 2, 4)), Want{})
	if s.Epochs != 2 || s.Steps != 4 || s.StepsPerEpoch != 2 || s.GlobalBatch != 4 || s.Samples != 16 || s.Superseded != 8 || len(s.Gens) != 2 {
		t.Errorf("summary %+v", s)
	}
	if got := s.String(); !strings.HasSuffix(got, "gens 2 (1 to 2), 8 lines of rolled-back steps superseded: OK\n") {
		t.Errorf("String() = %q", got)
	}
}

func TestRead(t *testing.T) {
	good := `{"gen":3,"step":1,"epoch":0,"rank":1,"world":2,"micro":0,"idx":[5,7]}` + "\n"
	ls, cut, err := Read(strings.NewReader(good+`{"gen":3,"st`), "f")
	if err != nil || cut != 1 || len(ls) != 1 || ls[0].Gen != 3 || ls[0].Rank != 1 || ls[0].Idx[1] != 7 {
		t.Errorf("Read with a cut last line: %+v, cut %d, %v", ls, cut, err)
	}
	if _, _, err := Read(strings.NewReader(good+"{bad\n"+good), "f"); err == nil || !strings.Contains(err.Error(), "f:2:") {
		t.Errorf("Read of a bad line: %v, want an error naming f:2", err)
	}
}
