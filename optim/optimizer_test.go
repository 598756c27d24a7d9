package optim

import (
	"math"
	"testing"
)

// ref is a float64 reference optimizer written straight from the formulas in the package docs
// (torch.optim semantics), independent of the float32 kernels under test.
type ref struct {
	cfg        Config
	p, m, v, b []float64
	t          int
}

func newRef(cfg Config, p0 []float32) *ref {
	r := &ref{cfg: cfg, p: make([]float64, len(p0)), m: make([]float64, len(p0)), v: make([]float64, len(p0)), b: make([]float64, len(p0))}
	for i, x := range p0 {
		r.p[i] = float64(x)
	}
	return r
}

func (r *ref) step(grads []float32, lr, scale float32) {
	c := r.cfg
	lr64, wd := float64(lr), c.WeightDecay
	r.t++
	for i := range r.p {
		g := float64(grads[i]) * float64(scale)
		switch c.Type {
		case TypeSGD:
			g += wd * r.p[i]
			if c.Momentum != 0 {
				if r.t == 1 {
					r.b[i] = g
				} else {
					r.b[i] = c.Momentum*r.b[i] + g
				}
				if c.Nesterov {
					g += c.Momentum * r.b[i]
				} else {
					g = r.b[i]
				}
			}
			r.p[i] -= lr64 * g
		case TypeAdam, TypeAdamW:
			if c.Type == TypeAdamW {
				r.p[i] *= 1 - lr64*wd
			} else {
				g += wd * r.p[i]
			}
			b1, b2 := c.Betas[0], c.Betas[1]
			r.m[i] = b1*r.m[i] + (1-b1)*g
			r.v[i] = b2*r.v[i] + (1-b2)*g*g
			bc1 := 1 - math.Pow(b1, float64(r.t))
			bc2 := 1 - math.Pow(b2, float64(r.t))
			r.p[i] -= (lr64 / bc1) * r.m[i] / (math.Sqrt(r.v[i])/math.Sqrt(bc2) + c.Eps)
		}
	}
}

// close32 reports whether got is within rel of want, relative to |want| (absolute below 1e-9,
// where the float32 rounding of a zero-crossing value dominates).
func close32(got float32, want, rel float64) bool {
	return math.Abs(float64(got)-want) <= rel*math.Max(math.Abs(want), 1e-9)
}

func checkClose(t *testing.T, what string, step int, got []float32, want []float64) {
	t.Helper()
	for i := range want {
		if !close32(got[i], want[i], 1e-6) {
			t.Errorf("step %d: %s[%d] = %.9g, want %.9g (rel err %.2g)", step, what, i, got[i], want[i], math.Abs(float64(got[i])-want[i])/math.Abs(want[i]))
		}
	}
}

func mustNew(t testing.TB, cfg Config, n int) Optimizer {
	t.Helper()
	o, err := New(cfg, n)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { o.Close() })
	return o
}

func state(o Optimizer, name string) []float32 {
	for _, b := range o.State() {
		if b.Name == name {
			return b.Data
		}
	}
	return nil
}

// A tiny problem with mixed signs, a zero parameter and a parameter whose gradient is always 0,
// stepped three times with a changing learning rate (as a schedule would) so that the bias
// corrections at t = 1, 2, 3 are all exercised.
//
// The gradients flip sign, but never so that a parameter or moment ends up as the small
// difference of much larger terms: float32 would then lose relative precision to cancellation,
// and a 1e-6 relative comparison would test the data instead of the code.
var (
	tinyP0    = []float32{0.5, -1.25, 2, 0, 0.75}
	tinyGrads = [][]float32{
		{0.1, -0.4, 1.5, 0.2, 0},
		{-0.3, -0.2, 1.0, 0.6, 0},
		{-0.05, 0.7, -0.5, 0.1, 0},
	}
	tinyLR = []float32{0.01, 0.02, 0.005}
)

func TestAgainstReference(t *testing.T) {
	sgd := func(mu, wd float64, nesterov bool) Config {
		c := DefaultConfig()
		c.Type, c.LR, c.Momentum, c.WeightDecay, c.Nesterov = TypeSGD, 0.1, mu, wd, nesterov
		return c
	}
	adam := func(typ string, wd, b1, b2 float64) Config {
		c := DefaultConfig()
		c.Type, c.WeightDecay, c.Betas = typ, wd, [2]float64{b1, b2}
		return c
	}
	// With the default eps of 1e-8 the tiny problem's updates barely see eps; 0.05 is comparable
	// to sqrt(v̂), so a misplaced eps shows.
	bigEps := func(c Config) Config { c.Eps = 0.05; return c }
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"sgd", sgd(0, 0, false)},
		{"sgd/wd", sgd(0, 0.1, false)},
		{"sgd/momentum", sgd(0.9, 0, false)},
		{"sgd/momentum/wd", sgd(0.9, 0.05, false)},
		{"sgd/nesterov/wd", sgd(0.8, 0.05, true)},
		{"adam", adam(TypeAdam, 0, 0.9, 0.999)},
		{"adam/wd", adam(TypeAdam, 0.1, 0.9, 0.999)},
		{"adam/betas", adam(TypeAdam, 0.01, 0.5, 0.9)},
		{"adamw", adam(TypeAdamW, 0.1, 0.9, 0.999)},
		{"adamw/no-wd", adam(TypeAdamW, 0, 0.9, 0.999)},
		{"adamw/betas", adam(TypeAdamW, 0.3, 0.8, 0.95)},
		{"adam/eps", bigEps(adam(TypeAdam, 0.1, 0.9, 0.999))},
		{"adamw/eps", bigEps(adam(TypeAdamW, 0.1, 0.9, 0.999))},
	} {
		for _, scale := range []float32{1, 0.5} {
			t.Run(tc.name, func(t *testing.T) {
				o := mustNew(t, tc.cfg, len(tinyP0))
				p := append([]float32(nil), tinyP0...)
				r := newRef(tc.cfg, p)
				for s, g := range tinyGrads {
					o.Step(p, g, tinyLR[s], scale)
					r.step(g, tinyLR[s], scale)
					checkClose(t, "param", s+1, p, r.p)
					if m := state(o, "exp_avg"); m != nil {
						checkClose(t, "exp_avg", s+1, m, r.m)
						checkClose(t, "exp_avg_sq", s+1, state(o, "exp_avg_sq"), r.v)
					}
					if b := state(o, "momentum_buffer"); b != nil {
						checkClose(t, "momentum_buffer", s+1, b, r.b)
					}
					if got := o.Steps(); got != int64(s+1) {
						t.Fatalf("Steps() = %d after %d steps", got, s+1)
					}
				}
			})
		}
	}
}

// Values worked out by hand from the update rules, one parameter p0 = 1, lr 0.1.
func TestHandComputed(t *testing.T) {
	sgd := func(mu float64, nesterov bool, wd float64) Config {
		c := DefaultConfig()
		c.Type, c.LR, c.Momentum, c.Nesterov, c.WeightDecay = TypeSGD, 0.1, mu, nesterov, wd
		return c
	}
	for _, tc := range []struct {
		name  string
		cfg   Config
		grad  float32 // the same raw gradient every step
		scale float32
		want  []float64 // p after steps 1, 2, 3
	}{
		// buf: 1, 1.9, 2.71; p: 1-0.1, 0.9-0.19, 0.71-0.271.
		{"momentum", sgd(0.9, false, 0), 1, 1, []float64{0.9, 0.71, 0.439}},
		// buf: 1, 1.9, 2.71; g = 1 + 0.9*buf: 1.9, 2.71, 3.439.
		{"nesterov", sgd(0.9, true, 0), 1, 1, []float64{0.81, 0.539, 0.1951}},
		// g = 2*0.5 + 0.1*p: 1.1, 1.089, 1.07811.
		{"wd+scale", sgd(0, false, 0.1), 2, 0.5, []float64{0.89, 0.7811, 0.673289}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := mustNew(t, tc.cfg, 1)
			p := []float32{1}
			for s, want := range tc.want {
				o.Step(p, []float32{tc.grad}, 0.1, tc.scale)
				if !close32(p[0], want, 1e-6) {
					t.Errorf("step %d: p = %.9g, want %.9g", s+1, p[0], want)
				}
			}
		})
	}
}

// With a constant gradient g, Adam's bias-corrected moments are exactly g and g² at every t, so
// each step moves p by lr*g/(|g|+eps): closed forms that check the bias corrections at t = 1..3.
func TestAdamConstantGradientClosedForm(t *testing.T) {
	const lr, g, eps = 0.1, -4.0, 1e-8
	move := lr * g / (math.Abs(g) + eps)
	t.Run("adam", func(t *testing.T) {
		c := DefaultConfig()
		c.Type, c.WeightDecay = TypeAdam, 0
		o := mustNew(t, c, 1)
		p := []float32{1}
		for s := 1; s <= 3; s++ {
			o.Step(p, []float32{g * 4}, lr, 0.25) // gradScale undoes a loss scale of 4
			if want := 1 - float64(s)*move; !close32(p[0], want, 1e-6) {
				t.Errorf("t=%d: p = %.9g, want %.9g", s, p[0], want)
			}
		}
	})
	t.Run("adamw", func(t *testing.T) {
		// Decoupled decay leaves the gradient alone: p_t = p_{t-1}*(1 - lr*wd) - move.
		c := DefaultConfig()
		c.WeightDecay = 0.5
		o := mustNew(t, c, 1)
		p := []float32{1}
		want := 1.0
		for s := 1; s <= 3; s++ {
			o.Step(p, []float32{g}, lr, 1)
			want = want*(1-lr*0.5) - move
			if !close32(p[0], want, 1e-6) {
				t.Errorf("t=%d: p = %.9g, want %.9g", s, p[0], want)
			}
		}
		// Written out (g < 0, so each step adds lr): 1*0.95+0.1 = 1.05, 1.05*0.95+0.1 = 1.0975,
		// 1.0975*0.95+0.1 = 1.142625.
		if !close32(p[0], 1.142625, 1e-6) {
			t.Errorf("p after 3 steps = %.9g, want 1.142625", p[0])
		}
	})
}

// Adam's first step is lr * g/|g| (the bias-corrected m/sqrt(v) is g/|g|): every parameter moves
// by lr against the sign of its gradient, whatever the gradient's magnitude.
func TestAdamFirstStepIsLRTimesSign(t *testing.T) {
	for _, typ := range []string{TypeAdam, TypeAdamW} {
		c := DefaultConfig()
		c.Type, c.WeightDecay = typ, 0
		const n, lr = 1000, 1e-3
		o := mustNew(t, c, n)
		p := make([]float32, n)
		g := make([]float32, n)
		for i := range g {
			// magnitudes from 1e-2 to 1e4, alternating signs
			g[i] = float32(math.Pow(10, -2+6*float64(i)/n))
			if i%2 == 1 {
				g[i] = -g[i]
			}
		}
		o.Step(p, g, lr, 1)
		for i := range p {
			want := -lr * math.Copysign(1, float64(g[i]))
			if math.Abs(float64(p[i])-want) > 1e-5*lr {
				t.Fatalf("%s: p[%d] moved by %.9g for g = %g, want %.9g", typ, i, p[i], g[i], want)
			}
		}
	}
}

func TestStateBuffers(t *testing.T) {
	names := func(o Optimizer) []string {
		var s []string
		for _, b := range o.State() {
			if len(b.Data) != o.Len() {
				t.Errorf("%s has length %d, want %d", b.Name, len(b.Data), o.Len())
			}
			s = append(s, b.Name)
		}
		return s
	}
	for _, tc := range []struct {
		typ      string
		momentum float64
		want     []string
	}{
		{TypeAdam, 0, []string{"exp_avg", "exp_avg_sq"}},
		{TypeAdamW, 0, []string{"exp_avg", "exp_avg_sq"}},
		{TypeSGD, 0.9, []string{"momentum_buffer"}},
		{TypeSGD, 0, nil},
	} {
		c := DefaultConfig()
		c.Type, c.Momentum = tc.typ, tc.momentum
		o := mustNew(t, c, 3)
		got := names(o)
		if len(got) != len(tc.want) {
			t.Fatalf("%s momentum %v: State names %v, want %v", tc.typ, tc.momentum, got, tc.want)
		}
		for i := range got {
			if got[i] != tc.want[i] {
				t.Fatalf("%s momentum %v: State names %v, want %v", tc.typ, tc.momentum, got, tc.want)
			}
		}
	}
}

// Writing into State() changes the next Step exactly as if the optimizer had reached that state
// itself: the buffers are views, and the next step uses them.
func TestStateViewsFeedNextStep(t *testing.T) {
	for _, typ := range []string{TypeAdam, TypeAdamW, TypeSGD} {
		t.Run(typ, func(t *testing.T) {
			c := DefaultConfig()
			c.Type = typ
			o := mustNew(t, c, len(tinyP0))
			p := append([]float32(nil), tinyP0...)
			r := newRef(c, p)
			o.Step(p, tinyGrads[0], tinyLR[0], 1)
			r.step(tinyGrads[0], tinyLR[0], 1)
			// Overwrite the state through the views, and the reference's state likewise.
			for _, b := range o.State() {
				for i := range b.Data {
					x := 0.01 * float32(i+1)
					b.Data[i] = x
					switch b.Name {
					case "exp_avg":
						r.m[i] = float64(x)
					case "exp_avg_sq":
						r.v[i] = float64(x)
					case "momentum_buffer":
						r.b[i] = float64(x)
					default:
						t.Fatalf("unexpected buffer %q", b.Name)
					}
				}
			}
			o.Step(p, tinyGrads[1], tinyLR[1], 1)
			r.step(tinyGrads[1], tinyLR[1], 1)
			checkClose(t, "param", 2, p, r.p)
		})
	}
}

// A checkpoint restore — copy params and State, SetSteps — continues bit for bit; without
// SetSteps, Adam's bias correction (and SGD's first-step buffer rule) would be wrong.
func TestSetStepsRestores(t *testing.T) {
	for _, typ := range []string{TypeAdam, TypeAdamW, TypeSGD} {
		t.Run(typ, func(t *testing.T) {
			c := DefaultConfig()
			c.Type = typ
			a := mustNew(t, c, len(tinyP0))
			pa := append([]float32(nil), tinyP0...)
			for s := 0; s < 2; s++ {
				a.Step(pa, tinyGrads[s], tinyLR[s], 1)
			}
			restore := func(setSteps bool) []float32 {
				b := mustNew(t, c, len(tinyP0))
				for i, buf := range a.State() {
					copy(b.State()[i].Data, buf.Data)
				}
				if setSteps {
					b.SetSteps(a.Steps())
				}
				pb := append([]float32(nil), pa...)
				b.Step(pb, tinyGrads[2], tinyLR[2], 1)
				return pb
			}
			restored, fresh := restore(true), restore(false)
			a.Step(pa, tinyGrads[2], tinyLR[2], 1)
			if a.Steps() != 3 {
				t.Fatalf("Steps() = %d, want 3", a.Steps())
			}
			for i := range pa {
				if math.Float32bits(restored[i]) != math.Float32bits(pa[i]) {
					t.Fatalf("restored p[%d] = %.9g, uninterrupted %.9g", i, restored[i], pa[i])
				}
			}
			same := true
			for i := range pa {
				same = same && fresh[i] == pa[i]
			}
			if same {
				t.Fatal("restoring without SetSteps gave the same result: the step count is not used")
			}
		})
	}
}

func TestStepPanicsOnLengthMismatch(t *testing.T) {
	o := mustNew(t, DefaultConfig(), 4)
	for _, tc := range []struct{ p, g int }{{3, 4}, {4, 5}, {0, 0}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("Step with len(params)=%d, len(grads)=%d on length 4: no panic", tc.p, tc.g)
				}
			}()
			o.Step(make([]float32, tc.p), make([]float32, tc.g), 0.1, 1)
		}()
	}
	if o.Steps() != 0 {
		t.Fatalf("Steps() = %d after rejected steps", o.Steps())
	}
}
