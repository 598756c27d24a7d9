package optim

import (
	"math"

	"github.com/qvd/qvd/internal/vec"
)

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

func newAdam(cfg Config, n int) (*adam, error) {
	o := &adam{
		b1:        cfg.Betas[0],
		b2:        cfg.Betas[1],
		wd:        cfg.WeightDecay,
		decoupled: cfg.Type == TypeAdamW,
	}
	o.m = o.mem.float32s(n, "exp_avg")
	o.v = o.mem.float32s(n, "exp_avg_sq")
	if err := o.mem.failed(); err != nil {
		return nil, err
	}
	o.k = adamPass{m: o.m, v: o.v, c: adamConsts(cfg), l2: !o.decoupled && cfg.WeightDecay != 0}
	return o, nil
}

// adamConsts are the constants of cfg's Adam kernels that do not change between steps.
func adamConsts(cfg Config) vec.AdamConsts {
	return vec.AdamConsts{
		B1: float32(cfg.Betas[0]), C1: float32(1 - cfg.Betas[0]),
		B2: float32(cfg.Betas[1]), C2: float32(1 - cfg.Betas[1]),
		Eps: float32(cfg.Eps),
		WD:  float32(cfg.WeightDecay),
		// Without weight decay Adam's update is AdamW's with a decay factor of exactly 1,
		// and p*1 == p bit for bit, so that case shares the decoupled kernel.
		Decay: 1,
	}
}

// setStepConsts sets c's per-step constants for step t (1-based): the bias corrections and
// the decoupled decay computed in float64 and then rounded, as PyTorch does with its
// Python-float scalars.
func setStepConsts(c *vec.AdamConsts, b1, b2, wd float64, decoupled bool, t int64, lr, gradScale float32) {
	bc1 := 1 - math.Pow(b1, float64(t))
	bc2 := 1 - math.Pow(b2, float64(t))
	c.Scale = gradScale
	c.NegStep = float32(-float64(lr) / bc1)
	c.BC2Sqrt = float32(math.Sqrt(bc2))
	if decoupled {
		c.Decay = float32(1 - float64(lr)*wd)
	}
}

func (o *adam) Step(params, grads []float32, lr, gradScale float32) {
	o.checkStep(params, grads)
	t := o.steps.Load() + 1
	k := &o.k
	k.p, k.g = params, grads
	setStepConsts(&k.c, o.b1, o.b2, o.wd, o.decoupled, t, lr, gradScale)
	o.pool.Run(o.n, o.grain, k)
	k.p, k.g = nil, nil // keep no reference to the caller's buffers
	o.steps.Store(t)
}

func (o *adam) State() []NamedBuffer {
	if o.closed {
		return nil
	}
	return []NamedBuffer{{Name: "exp_avg", Data: o.m}, {Name: "exp_avg_sq", Data: o.v}}
}

func (o *adam) Close() error {
	o.m, o.v, o.k.m, o.k.v = nil, nil, nil, nil
	return o.close()
}

// adamPass is one Step's update as a Ranger. The per-element arithmetic is internal/vec's
// AdamW and AdamL2: AVX2 on amd64 CPUs that have it, plain Go loops elsewhere, with the same
// bits either way.
type adamPass struct {
	p, g, m, v []float32
	c          vec.AdamConsts // per-optimizer fields set in newAdam, per-step ones in Step
	l2         bool
}

func (k *adamPass) Range(lo, hi int) {
	p, g, m, v := k.p[lo:hi], k.g[lo:hi], k.m[lo:hi], k.v[lo:hi]
	if k.l2 {
		vec.AdamL2(p, g, m, v, &k.c)
	} else {
		vec.AdamW(p, g, m, v, &k.c)
	}
}

// AdamWConsts returns the constants of AdamW step t (1-based) for cfg — AdamW, or Adam
// without weight decay, which is the same update — computed exactly as the CPU optimizer
// computes them, so a device kernel given them produces the same bits.
func AdamWConsts(cfg Config, t int64, lr, gradScale float32) vec.AdamConsts {
	c := adamConsts(cfg)
	setStepConsts(&c, cfg.Betas[0], cfg.Betas[1], cfg.WeightDecay, cfg.Type == TypeAdamW, t, lr, gradScale)
	return c
}
