package trainer

import (
	"math"
	"testing"
)

func TestScalerDynamic(t *testing.T) {
	cfg := ScalerConfig{InitialScalePower: 16, Window: 3, Hysteresis: 2, MinScale: 1024}
	s := NewScaler(cfg)
	if s.Scale() != 65536 {
		t.Fatalf("initial scale %v, want 2^16", s.Scale())
	}
	type step struct {
		overflow  bool
		wantSkip  bool
		wantScale float64
	}
	steps := []step{
		{false, false, 65536},
		{false, false, 65536},
		{false, false, 131072}, // 3 clean steps: grow ×2
		{true, true, 131072},   // first overflow absorbed by hysteresis (2 → 1)
		{true, true, 65536},    // second: back off ×0.5
		{true, true, 32768},    // hysteresis stays exhausted until the next growth
		{false, false, 32768},
		{true, true, 16384}, // an overflow resets the clean-step count
		{false, false, 16384},
		{false, false, 16384},
		{false, false, 32768}, // grew: hysteresis restored to 2
		{true, true, 32768},   // absorbed again
	}
	for i, st := range steps {
		skip, _ := s.Update(st.overflow)
		if skip != st.wantSkip || s.Scale() != st.wantScale {
			t.Fatalf("step %d (overflow=%v): skip=%v scale=%v, want skip=%v scale=%v", i, st.overflow, skip, s.Scale(), st.wantSkip, st.wantScale)
		}
	}
	if got := s.State().Overflows; got != 5 {
		t.Fatalf("overflows = %d, want 5", got)
	}
}

func TestScalerMinScaleAndConsecutiveHysteresis(t *testing.T) {
	s := NewScaler(ScalerConfig{InitialScalePower: 2, Window: 100, Hysteresis: 1, MinScale: 2})
	for i := 0; i < 5; i++ {
		s.Update(true)
	}
	if s.Scale() != 2 {
		t.Fatalf("scale %v, want the floor 2", s.Scale())
	}
	c := NewScaler(ScalerConfig{InitialScalePower: 10, Window: 100, Hysteresis: 2, ConsecutiveHysteresis: true, MinScale: 1})
	c.Update(true)  // absorbed
	c.Update(false) // consecutive: restores hysteresis
	c.Update(true)  // absorbed again
	if c.Scale() != 1024 {
		t.Fatalf("consecutive hysteresis: scale %v, want 1024", c.Scale())
	}
}

func TestScalerStatic(t *testing.T) {
	s := NewScaler(ScalerConfig{LossScale: 128, InitialScalePower: 16, Window: 1, Hysteresis: 1, MinScale: 1})
	if skip, _ := s.Update(true); !skip || s.Scale() != 128 {
		t.Fatalf("static overflow: skip=%v scale=%v", skip, s.Scale())
	}
	if skip, _ := s.Update(false); skip || s.Scale() != 128 {
		t.Fatalf("static clean: skip=%v scale=%v", skip, s.Scale())
	}
}

func TestScalerStateRoundTrip(t *testing.T) {
	cfg := DefaultScalerConfig()
	a := NewScaler(cfg)
	for i := 0; i < 7; i++ {
		a.Update(i%3 == 0)
	}
	b := NewScaler(cfg)
	if err := b.SetState(a.State()); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 50; i++ {
		o := i%11 == 0
		sa, _ := a.Update(o)
		sb, _ := b.Update(o)
		if sa != sb || a.State() != b.State() {
			t.Fatalf("diverged at %d: %+v vs %+v", i, a.State(), b.State())
		}
	}
	if err := b.SetState(ScalerState{Scale: math.NaN()}); err == nil {
		t.Fatal("NaN scale accepted")
	}
}

func TestScalerConfigValidate(t *testing.T) {
	bad := []ScalerConfig{
		{LossScale: -1, InitialScalePower: 16, Window: 1, Hysteresis: 1, MinScale: 1},
		{InitialScalePower: 70, Window: 1, Hysteresis: 1, MinScale: 1},
		{InitialScalePower: 16, Window: 0, Hysteresis: 1, MinScale: 1},
		{InitialScalePower: 16, Window: 1, Hysteresis: 0, MinScale: 1},
		{InitialScalePower: 16, Window: 1, Hysteresis: 1, MinScale: 0},
		{InitialScalePower: 2, Window: 1, Hysteresis: 1, MinScale: 8},
	}
	for i, c := range bad {
		if err := c.Validate(); err == nil {
			t.Errorf("case %d: %+v accepted", i, c)
		}
	}
	if err := DefaultScalerConfig().Validate(); err != nil {
		t.Fatal(err)
	}
}
