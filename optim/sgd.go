package optim

// sgd is stochastic gradient descent with optional (Nesterov) momentum, following
// torch.optim.SGD with dampening 0:
//
//	g = grad*gradScale + wd*p        (the L2 term only when wd != 0)
//	buf = g on the first step, else mu*buf + g
//	g = g + mu*buf if nesterov, else buf
//	p = p - lr*g
//
// per element in float32. Nesterov momentum in this form is Sutskever et al., "On the importance
// of initialization and momentum in deep learning", 2013, as reformulated by PyTorch.
type sgd struct {
	base
	buf []float32 // nil without momentum (or for n == 0)
	k   sgdPass
}

func newSGD(cfg Config, n int) (*sgd, error) {
	o := &sgd{}
	if cfg.Momentum != 0 {
		o.buf = o.mem.float32s(n, "momentum_buffer")
		if err := o.mem.failed(); err != nil {
			return nil, err
		}
	}
	o.k = sgdPass{
		buf:      o.buf,
		momentum: cfg.Momentum != 0,
		nesterov: cfg.Nesterov,
		mu:       float32(cfg.Momentum),
		wd:       float32(cfg.WeightDecay),
	}
	return o, nil
}

func (o *sgd) Step(params, grads []float32, lr, gradScale float32) {
	o.checkStep(params, grads)
	k := &o.k
	k.p, k.g = params, grads
	k.scale, k.negLR = gradScale, -lr
	// PyTorch creates the buffer as a copy of the first gradient; a restored checkpoint has
	// Steps() > 0 and continues from the saved buffer.
	k.first = o.steps.Load() == 0
	o.pool.Run(o.n, o.grain, k)
	k.p, k.g = nil, nil // keep no reference to the caller's buffers
	o.steps.Add(1)
}

func (o *sgd) State() []NamedBuffer {
	if !o.k.momentum || o.closed {
		return nil
	}
	return []NamedBuffer{{Name: "momentum_buffer", Data: o.buf}}
}

func (o *sgd) Close() error {
	o.buf, o.k.buf = nil, nil
	return o.close()
}

// sgdPass is one Step's update as a Ranger.
type sgdPass struct {
	p, g, buf          []float32
	momentum, nesterov bool
	mu, wd             float32
	scale, negLR       float32
	first              bool
}

func (k *sgdPass) Range(lo, hi int) {
	p := k.p[lo:hi]
	g := k.g[lo:hi]
	g = g[:len(p)] // equal lengths let the compiler drop the bounds checks
	scale, negLR, wd := k.scale, k.negLR, k.wd
	if !k.momentum {
		for i := range p {
			gi := float32(g[i] * scale)
			if wd != 0 {
				gi += float32(wd * p[i])
			}
			p[i] += float32(negLR * gi)
		}
		return
	}
	buf := k.buf[lo:hi]
	buf = buf[:len(p)]
	mu, first, nesterov := k.mu, k.first, k.nesterov
	// The branches on wd, first and nesterov are loop-invariant and predicted perfectly; the
	// loop is bound by memory traffic, not by them.
	for i := range p {
		gi := float32(g[i] * scale)
		if wd != 0 {
			gi += float32(wd * p[i])
		}
		b := gi
		if !first {
			b = float32(mu*buf[i]) + gi
		}
		buf[i] = b
		if nesterov {
			gi += float32(mu * b)
		} else {
			gi = b
		}
		p[i] += float32(negLR * gi)
	}
}
