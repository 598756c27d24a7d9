package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
)

// Line is one micro-batch of the sample log (trainer.SampleLog): the samples rank Rank of a
// World-rank group of generation Gen filled for micro-batch Micro of step Step (1-based) in
// epoch Epoch.
type Line struct {
	Gen   uint64  `json:"gen"`
	Step  int64   `json:"step"`
	Epoch int     `json:"epoch"`
	Rank  int     `json:"rank"`
	World int     `json:"world"`
	Micro int     `json:"micro"`
	Idx   []int32 `json:"idx"`
}

// Want is what the run should have trained; a zero field is taken from the log (the global
// batch from step 1, the steps per epoch from the first epoch) or not checked.
type Want struct {
	GlobalBatch   int
	StepsPerEpoch int
	Epochs        int
	TrainSize     int // sample indices are in [0, TrainSize)
}

// Summary is what Check found. Problems lists the violations (at most maxProblems, then a
// count): none means every epoch trained each of its samples exactly once.
type Summary struct {
	Epochs, StepsPerEpoch, GlobalBatch int
	Steps                              int64
	Samples                            int // in the kept lines
	Duplicates                         int // samples trained twice or more within an epoch (counted per extra time)
	Lost                               int // samples an epoch is short of steps × global batch
	Gens                               []uint64
	Superseded                         int // lines of steps that a larger generation trained again
	Problems                           []string
	more                               int
}

const maxProblems = 20

func (s *Summary) problem(format string, a ...any) {
	if len(s.Problems) < maxProblems {
		s.Problems = append(s.Problems, fmt.Sprintf(format, a...))
		return
	}
	s.more++
}

// String is the one-paragraph account samplecheck prints.
func (s Summary) String() string {
	gens := "none"
	if len(s.Gens) > 0 {
		gens = fmt.Sprintf("%d (%d to %d)", len(s.Gens), s.Gens[0], s.Gens[len(s.Gens)-1])
	}
	out := fmt.Sprintf("samplecheck: %d epochs, %d steps (%d per epoch), %d samples (global batch %d), %d duplicates, %d lost, gens %s, %d lines of rolled-back steps superseded",
		s.Epochs, s.Steps, s.StepsPerEpoch, s.Samples, s.GlobalBatch, s.Duplicates, s.Lost, gens, s.Superseded)
	if len(s.Problems) == 0 {
		return out + ": OK\n"
	}
	out += fmt.Sprintf(": %d problems\n", len(s.Problems)+s.more)
	for _, p := range s.Problems {
		out += "  " + p + "\n"
	}
	if s.more > 0 {
		out += fmt.Sprintf("  ... and %d more\n", s.more)
	}
	return out
}

// Read parses a sample log. A last line cut short (no newline and not JSON) is skipped and
// counted in cut; any other bad line is an error naming it.
func Read(r io.Reader, name string) (lines []Line, cut int, err error) {
	br := bufio.NewReader(r)
	for n := 1; ; n++ {
		b, rerr := br.ReadBytes('\n')
		if len(b) > 0 {
			var l Line
			if err := json.Unmarshal(b, &l); err != nil {
				if rerr == io.EOF && b[len(b)-1] != '\n' {
					return lines, 1, nil
				}
				return nil, 0, fmt.Errorf("%s:%d: %v", name, n, err)
			}
			lines = append(lines, l)
		}
		if rerr == io.EOF {
			return lines, 0, nil
		}
		if rerr != nil {
			return nil, 0, fmt.Errorf("%s: %w", name, rerr)
		}
	}
}

// Check keeps, for every step, the lines of the largest generation that logged it (a step
// that was rolled back was trained again under a later one), and checks that they make a
// whole step — one world, one epoch, every rank's micro-batches once, global batch samples —
// that the steps run from 1 without a gap, and that each epoch's union of samples has no
// duplicate and exactly steps per epoch × global batch entries.
func Check(all []Line, want Want) Summary {
	var s Summary
	maxGen := map[int64]uint64{}
	gens := map[uint64]bool{}
	for _, l := range all {
		gens[l.Gen] = true
		if g, ok := maxGen[l.Step]; !ok || l.Gen > g {
			maxGen[l.Step] = l.Gen
		}
	}
	for g := range gens {
		s.Gens = append(s.Gens, g)
	}
	slices.Sort(s.Gens)
	byStep := map[int64][]Line{}
	for _, l := range all {
		if l.Gen != maxGen[l.Step] {
			s.Superseded++
			continue
		}
		byStep[l.Step] = append(byStep[l.Step], l)
	}
	steps := make([]int64, 0, len(byStep))
	for st := range byStep {
		steps = append(steps, st)
	}
	slices.Sort(steps)
	if len(steps) == 0 {
		s.problem("no sample lines")
		return s
	}
	s.Steps = steps[len(steps)-1]
	if steps[0] != 1 {
		s.problem("the first step logged is %d, not 1", steps[0])
	}
	for i := 1; i < len(steps); i++ {
		if steps[i] != steps[i-1]+1 {
			s.problem("steps %d to %d are missing", steps[i-1]+1, steps[i]-1)
		}
	}
	s.GlobalBatch = want.GlobalBatch
	epochSteps := map[int]int{}
	epochIdx := map[int][]int32{}
	lastEpoch := -1
	for _, st := range steps {
		ls := byStep[st]
		sort.Slice(ls, func(i, j int) bool {
			return ls[i].Rank < ls[j].Rank || ls[i].Rank == ls[j].Rank && ls[i].Micro < ls[j].Micro
		})
		l0, n := ls[0], 0
		micros := map[[2]int]bool{}
		perRank := map[int]int{}
		for _, l := range ls {
			if l.World != l0.World || l.Epoch != l0.Epoch {
				s.problem("step %d (gen %d): lines disagree on world (%d, %d) or epoch (%d, %d)", st, l.Gen, l0.World, l.World, l0.Epoch, l.Epoch)
			}
			if l.Rank < 0 || l.Rank >= l.World {
				s.problem("step %d (gen %d): rank %d outside world %d", st, l.Gen, l.Rank, l.World)
			}
			k := [2]int{l.Rank, l.Micro}
			if micros[k] {
				s.problem("step %d (gen %d): rank %d logged micro-batch %d twice", st, l.Gen, l.Rank, l.Micro)
			}
			micros[k] = true
			perRank[l.Rank]++
			n += len(l.Idx)
			for _, i := range l.Idx {
				if i < 0 || want.TrainSize > 0 && int(i) >= want.TrainSize {
					s.problem("step %d: sample %d outside the training set [0, %d)", st, i, want.TrainSize)
				}
			}
			epochIdx[l0.Epoch] = append(epochIdx[l0.Epoch], l.Idx...)
		}
		if len(perRank) != l0.World {
			s.problem("step %d (gen %d): %d of world %d ranks logged it", st, l0.Gen, len(perRank), l0.World)
		}
		if s.GlobalBatch == 0 {
			s.GlobalBatch = n
		}
		if n != s.GlobalBatch {
			s.problem("step %d (gen %d, world %d): %d samples, want the global batch %d", st, l0.Gen, l0.World, n, s.GlobalBatch)
		}
		if l0.Epoch < lastEpoch {
			s.problem("step %d is in epoch %d, after a step of epoch %d", st, l0.Epoch, lastEpoch)
		}
		lastEpoch = max(lastEpoch, l0.Epoch)
		epochSteps[l0.Epoch]++
		s.Samples += n
	}
	epochs := make([]int, 0, len(epochSteps))
	for e := range epochSteps {
		epochs = append(epochs, e)
	}
	slices.Sort(epochs)
	s.Epochs = len(epochs)
	if want.Epochs > 0 && s.Epochs != want.Epochs {
		s.problem("%d epochs logged, want %d", s.Epochs, want.Epochs)
	}
	s.StepsPerEpoch = want.StepsPerEpoch
	if s.StepsPerEpoch == 0 {
		s.StepsPerEpoch = epochSteps[epochs[0]]
	}
	for i, e := range epochs {
		if i > 0 && e != epochs[i-1]+1 {
			s.problem("epochs %d to %d are missing", epochs[i-1]+1, e-1)
		}
		if epochSteps[e] != s.StepsPerEpoch {
			s.problem("epoch %d has %d steps, want %d", e, epochSteps[e], s.StepsPerEpoch)
		}
		seen := make(map[int32]bool, len(epochIdx[e]))
		dups := 0
		for _, i := range epochIdx[e] {
			if seen[i] {
				dups++
			}
			seen[i] = true
		}
		if dups > 0 {
			s.problem("epoch %d: %d samples trained more than once", e, dups)
		}
		s.Duplicates += dups
		if want := s.StepsPerEpoch * s.GlobalBatch; len(seen) < want {
			s.Lost += want - len(seen)
			s.problem("epoch %d: %d distinct samples, want %d steps × %d = %d", e, len(seen), s.StepsPerEpoch, s.GlobalBatch, want)
		} else if len(epochIdx[e]) != want {
			s.problem("epoch %d: %d samples, want %d steps × %d = %d", e, len(epochIdx[e]), s.StepsPerEpoch, s.GlobalBatch, want)
		}
	}
	return s
}
