package trainer

import (
	"math"
	"testing"
)

func TestScheduleFactor(t *testing.T) {
	near := func(a, b float64) bool { return math.Abs(a-b) < 1e-12 }
	cases := []struct {
		name  string
		cfg   ScheduleConfig
		step  int64
		total int64
		want  float64
	}{
		{"constant", ScheduleConfig{Type: ScheduleConstant, WarmupType: "linear"}, 500, 1000, 1},
		{"linear warmup first", ScheduleConfig{Type: ScheduleWarmup, WarmupSteps: 10, WarmupType: "linear"}, 0, 100, 0.1},
		{"linear warmup last", ScheduleConfig{Type: ScheduleWarmup, WarmupSteps: 10, WarmupType: "linear"}, 9, 100, 1},
		{"warmup then flat", ScheduleConfig{Type: ScheduleWarmup, WarmupSteps: 10, WarmupType: "linear"}, 50, 100, 1},
		{"warmup start ratio", ScheduleConfig{Type: ScheduleWarmup, WarmupSteps: 4, WarmupType: "linear", WarmupStartRatio: 0.2}, 1, 100, 0.2 + 0.8*0.5},
		{"log warmup", ScheduleConfig{Type: ScheduleWarmup, WarmupSteps: 100, WarmupType: "log"}, 9, 1000, math.Log(10) / math.Log(100)},
		{"cosine start", ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 10, WarmupType: "linear"}, 10, 110, 1},
		{"cosine middle", ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 10, WarmupType: "linear", MinRatio: 0.1}, 60, 110, 0.1 + 0.9*0.5},
		{"cosine end", ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 10, WarmupType: "linear", MinRatio: 0.1}, 110, 110, 0.1},
		{"cosine past end", ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 10, WarmupType: "linear", MinRatio: 0.1}, 500, 110, 0.1},
		{"cosine explicit total", ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 0, WarmupType: "linear", TotalSteps: 100}, 50, 99999, 0.5},
		{"linear decay quarter", ScheduleConfig{Type: ScheduleWarmupLinear, WarmupSteps: 0, WarmupType: "linear"}, 25, 100, 0.75},
		{"linear decay to min", ScheduleConfig{Type: ScheduleWarmupLinear, WarmupSteps: 0, WarmupType: "linear", MinRatio: 0.2}, 100, 100, 0.2},
	}
	for _, c := range cases {
		if err := c.cfg.Validate(); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got := c.cfg.Factor(c.step, c.total); !near(got, c.want) {
			t.Errorf("%s: Factor(%d, %d) = %v, want %v", c.name, c.step, c.total, got, c.want)
		}
	}
}

func TestScheduleMonotoneWarmup(t *testing.T) {
	for _, wt := range []string{"linear", "log"} {
		c := ScheduleConfig{Type: ScheduleWarmupCosine, WarmupSteps: 50, WarmupType: wt, MinRatio: 0}
		prev := -1.0
		for s := int64(0); s < 50; s++ {
			f := c.Factor(s, 200)
			if f < prev || f > 1 {
				t.Fatalf("%s warmup not monotone in (0,1] at %d: %v after %v", wt, s, f, prev)
			}
			prev = f
		}
		if c.Factor(49, 200) != 1 {
			t.Fatalf("%s warmup does not reach 1 at its last step: %v", wt, c.Factor(49, 200))
		}
	}
}

func TestScheduleValidate(t *testing.T) {
	bad := []ScheduleConfig{
		{Type: "step", WarmupType: "linear"},
		{Type: ScheduleWarmup, WarmupSteps: -1, WarmupType: "linear"},
		{Type: ScheduleWarmup, WarmupType: "exp"},
		{Type: ScheduleWarmupCosine, WarmupType: "linear", MinRatio: 2},
		{Type: ScheduleWarmupCosine, WarmupType: "linear", WarmupSteps: 10, TotalSteps: 5},
	}
	for i, c := range bad {
		if err := c.Validate(); err == nil {
			t.Errorf("case %d: %+v accepted", i, c)
		}
	}
}
