package offload

import "math"

// adam is Adam (Kingma & Ba, "Adam: A Method for Stochastic Optimization", 2015) with L2
// weight decay folded into the gradient, or, when decoupled, AdamW (Loshchilov & Hutter,
// "Decoupled Weight Decay Regularization", 2019), following torch.optim.Adam and AdamW:
//
//	adam:  g = grad*gradScale + wd*p               (the L2 term only when wd != 0)
//	adamw: p = p*(1 - lr*wd);  g = grad*gradScale
//	m = b1*m + (1-b1)*g
//	v = b2*v + (1-b2)*g*g
//	t = t+1
//	p = p - (lr/(1-b1^t)) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
//
// per element in float32, with the step size and sqrt(1-b2^t) computed once per step in float64
// and then rounded, as PyTorch does with its Python-float scalars.
type adam struct {
	base
	b1, b2, wd float64
	decoupled  bool
	m, v       []float32
	k          adamPass
}

func newAdam(cfg Config, n int) *adam {
	o := &adam{
		b1:        cfg.Betas[0],
		b2:        cfg.Betas[1],
		wd:        cfg.WeightDecay,
		decoupled: cfg.Type == TypeAdamW,
		m:         make([]float32, n),
		v:         make([]float32, n),
	}
	o.k = adamPass{
		m: o.m, v: o.v,
		b1: float32(cfg.Betas[0]), c1: float32(1 - cfg.Betas[0]),
		b2: float32(cfg.Betas[1]), c2: float32(1 - cfg.Betas[1]),
		eps: float32(cfg.Eps),
		// Without weight decay Adam's update is AdamW's with a decay factor of exactly 1, and
		// p*1 == p bit for bit, so that case shares the decoupled loop.
		l2:    !o.decoupled && cfg.WeightDecay != 0,
		wd:    float32(cfg.WeightDecay),
		decay: 1,
	}
	return o
}

func (o *adam) Step(params, grads []float32, lr, gradScale float32) {
	o.checkLen(params, grads)
	t := o.steps.Load() + 1
	bc1 := 1 - math.Pow(o.b1, float64(t))
	bc2 := 1 - math.Pow(o.b2, float64(t))
	k := &o.k
	k.p, k.g = params, grads
	k.scale = gradScale
	k.negStep = float32(-float64(lr) / bc1)
	k.bc2Sqrt = float32(math.Sqrt(bc2))
	if o.decoupled {
		k.decay = float32(1 - float64(lr)*o.wd)
	}
	o.pool.Run(o.n, o.grain, k)
	k.p, k.g = nil, nil // keep no reference to the caller's buffers
	o.steps.Store(t)
}

func (o *adam) State() []NamedBuffer {
	return []NamedBuffer{{Name: "exp_avg", Data: o.m}, {Name: "exp_avg_sq", Data: o.v}}
}

// adamPass is one Step's update as a Ranger.
type adamPass struct {
	p, g, m, v []float32
	// per-optimizer constants
	b1, c1, b2, c2, eps, wd float32 // c1 = 1-b1, c2 = 1-b2, rounded from float64
	l2                      bool
	// per-step constants
	scale, negStep, bc2Sqrt, decay float32
}

func (k *adamPass) Range(lo, hi int) {
	p, g, m, v := k.p[lo:hi], k.g[lo:hi], k.m[lo:hi], k.v[lo:hi]
	if k.l2 {
		adamL2(p, g, m, v, k)
	} else {
		adamDecoupled(p, g, m, v, k)
	}
}

// sqrt32 is correctly rounded: float64 carries more than twice float32's precision plus two
// bits, so rounding the float64 square root to float32 rounds only once in effect. The compiler
// turns it into a single SQRTSS.
func sqrt32(x float32) float32 { return float32(math.Sqrt(float64(x))) }

// The float32(...) conversions around products force them to be rounded before the addition,
// so no platform fuses them into FMAs: results are then the same on amd64 and arm64.
//
// The operation order follows PyTorch's kernels: addcmul(v, g, g, value=c) = v + c*g*g,
// addcdiv(p, m, denom, value=-s) = p + (-s*m)/denom.

func adamDecoupled(p, g, m, v []float32, k *adamPass) {
	g, m, v = g[:len(p)], m[:len(p)], v[:len(p)] // equal lengths: no bounds checks in the loop
	b1, c1, b2, c2, eps := k.b1, k.c1, k.b2, k.c2, k.eps
	scale, negStep, bc2Sqrt, decay := k.scale, k.negStep, k.bc2Sqrt, k.decay
	for i := range p {
		pi := float32(p[i] * decay)
		gi := float32(g[i] * scale)
		mi := float32(b1*m[i]) + float32(c1*gi)
		vi := float32(b2*v[i]) + float32(float32(c2*gi)*gi)
		denom := float32(sqrt32(vi)/bc2Sqrt) + eps
		p[i] = pi + float32(negStep*mi)/denom
		m[i], v[i] = mi, vi
	}
}

func adamL2(p, g, m, v []float32, k *adamPass) {
	g, m, v = g[:len(p)], m[:len(p)], v[:len(p)] // equal lengths: no bounds checks in the loop
	b1, c1, b2, c2, eps, wd := k.b1, k.c1, k.b2, k.c2, k.eps, k.wd
	scale, negStep, bc2Sqrt := k.scale, k.negStep, k.bc2Sqrt
	for i := range p {
		pi := p[i]
		gi := float32(g[i]*scale) + float32(wd*pi)
		mi := float32(b1*m[i]) + float32(c1*gi)
		vi := float32(b2*v[i]) + float32(float32(c2*gi)*gi)
		denom := float32(sqrt32(vi)/bc2Sqrt) + eps
		p[i] = pi + float32(negStep*mi)/denom
		m[i], v[i] = mi, vi
	}
}
