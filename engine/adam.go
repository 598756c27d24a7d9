package engine

import (
	"fmt"
	"math"

	"github.com/qvd/qvd/optim"
)

// Adam is the optimizer without offload: fp32 master weights and both moments in device
// memory, stepped by one fused kernel that reads the gradient where the engine left it and
// writes the working-precision weights in the same pass (no host round trip). Its arithmetic
// is the CPU optimizer's (optim.AdamWConsts and vec.AdamW's operation order, no fused
// multiply-add), so a device step and a host step give the same bits.
//
// Check is the loss scaler's half: unscale and the Inf/NaN test in one kernel, plus the
// squared norm for clipping, with two numbers coming back to the host to decide the step
// (in a group the caller all-reduces them so every rank skips or clips alike).
type Adam struct {
	dev       Device
	alloc     *Allocator
	cfg       optim.Config
	master    Buf
	m, v      Buf
	flag, acc Buf // F32[1]: overflow seen; Σ g²
	steps     int64
}

// NewAdam places master (the fp32 weights of the trainable part) and zeroed moments on the
// allocator's device. Adam with L2 weight decay (type adam, weight_decay > 0) adds the decay
// to the gradient, which the fused kernel does not do: it is refused.
func NewAdam(alloc *Allocator, cfg optim.Config, master []float32) (*Adam, error) {
	switch {
	case cfg.Type == optim.TypeAdamW:
	case cfg.Type == optim.TypeAdam && cfg.WeightDecay == 0:
	default:
		return nil, fmt.Errorf("engine: the device optimizer does adamw (and adam without weight_decay), not %s with weight_decay %v: use zero_optimization.offload_optimizer.device: cpu", cfg.Type, cfg.WeightDecay)
	}
	a := &Adam{dev: alloc.Device(), alloc: alloc, cfg: cfg}
	n := len(master)
	var err error
	for _, b := range []*Buf{&a.master, &a.m, &a.v} {
		if *b, err = alloc.Alloc(n, F32); err != nil {
			a.Close()
			return nil, fmt.Errorf("engine: optimizer state: %w", err)
		}
	}
	if a.flag, err = alloc.Alloc(1, F32); err == nil {
		a.acc, err = alloc.Alloc(1, F32)
	}
	if err != nil {
		a.Close()
		return nil, fmt.Errorf("engine: optimizer scalars: %w", err)
	}
	a.dev.Upload(a.master, master)
	a.dev.Fill(a.m, 0)
	a.dev.Fill(a.v, 0)
	if err := a.dev.Sync(); err != nil {
		a.Close()
		return nil, fmt.Errorf("engine: optimizer state: %w", err)
	}
	return a, nil
}

// Check multiplies g by unscale in place and reports whether any element was Inf or NaN
// (before unscaling) and Σ g² after it.
func (a *Adam) Check(g Buf, unscale float32) (overflow bool, sumsq float64, err error) {
	a.dev.Fill(a.flag, 0)
	a.dev.Fill(a.acc, 0)
	a.dev.UnscaleCheck(g, a.flag, unscale)
	a.dev.SumSquares(a.acc, g)
	var out [2]float32
	if err := a.dev.Download(out[:1], a.flag); err != nil {
		return false, 0, fmt.Errorf("engine: gradient check: %w", err)
	}
	if err := a.dev.Download(out[1:], a.acc); err != nil {
		return false, 0, fmt.Errorf("engine: gradient check: %w", err)
	}
	s := float64(out[1])
	return out[0] != 0 || math.IsNaN(s) || math.IsInf(s, 0), s, nil
}

// Step applies step Steps()+1 with learning rate lr to the gradient g×gradScale and writes
// the working weights into w (w.N == len(master); invalid w skips the store).
func (a *Adam) Step(g, w Buf, lr, gradScale float32) error {
	if g.N != a.master.N || (w.Valid() && w.N != a.master.N) {
		return fmt.Errorf("engine: optimizer step: gradient %d and weights %d for %d parameters", g.N, w.N, a.master.N)
	}
	t := a.steps + 1
	a.dev.AdamW(a.master, a.m, a.v, g, w, optim.AdamWConsts(a.cfg, t, lr, gradScale))
	if err := a.dev.Sync(); err != nil {
		return fmt.Errorf("engine: optimizer step %d: %w", t, err)
	}
	a.steps = t
	return nil
}

// Steps is the number of completed steps.
func (a *Adam) Steps() int64 { return a.steps }

// State copies the master weights and moments to the host (for a checkpoint).
func (a *Adam) State() (master, m, v []float32, err error) {
	n := a.master.N
	master, m, v = make([]float32, n), make([]float32, n), make([]float32, n)
	for _, p := range []struct {
		dst []float32
		src Buf
	}{{master, a.master}, {m, a.m}, {v, a.v}} {
		if err := a.dev.Download(p.dst, p.src); err != nil {
			return nil, nil, nil, fmt.Errorf("engine: reading optimizer state: %w", err)
		}
	}
	return master, m, v, nil
}

// Close frees the device state.
func (a *Adam) Close() {
	for _, b := range []*Buf{&a.master, &a.m, &a.v, &a.flag, &a.acc} {
		if b.Valid() {
			a.alloc.Free(*b)
			*b = Buf{}
		}
	}
}
