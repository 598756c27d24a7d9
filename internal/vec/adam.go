package vec

import "math"

// AdamConsts are the float32 scalars of one Adam or AdamW step, each rounded once from the
// float64 the optimizer computes it in. The assembly reads the fields through go_asm.h's
// offsets, so their order is free.
type AdamConsts struct {
	B1, C1  float32 // β1 and 1-β1
	B2, C2  float32 // β2 and 1-β2
	Eps     float32 // added to the corrected root of the second moment
	WD      float32 // L2 weight decay folded into the gradient (AdamL2 only)
	Scale   float32 // gradient scale, such as 1/loss scale
	NegStep float32 // -lr/(1-β1^t)
	BC2Sqrt float32 // sqrt(1-β2^t)
	Decay   float32 // decoupled weight decay factor 1-lr·wd (AdamW only)
}

// AdamW applies one AdamW step (Loshchilov & Hutter, "Decoupled Weight Decay Regularization",
// 2019) to parameters p and moments m and v in place, given gradients g. Per element:
//
//	p' = p*Decay
//	g' = g*Scale
//	m  = B1*m + C1*g'
//	v  = B2*v + (C2*g')*g'
//	p  = p' + (NegStep*m) / (sqrt(v)/BC2Sqrt + Eps)
//
// in that order, every operation rounded to float32 (no fused multiply-add, a correctly rounded
// square root): PyTorch's order, with the same bits on every CPU and build (see the package
// documentation for the one NaN case). With Decay = 1 it is Adam without weight decay. It
// panics if the lengths differ.
func AdamW(p, g, m, v []float32, c *AdamConsts) {
	mustSameLen4(p, g, m, v)
	adamW(p, g, m, v, c)
}

// AdamL2 is AdamW with the weight decay added to the gradient instead, as Adam (Kingma & Ba,
// 2015) does: g' = g*Scale + WD*p, and p' = p. Decay is not used. It panics if the lengths
// differ.
func AdamL2(p, g, m, v []float32, c *AdamConsts) {
	mustSameLen4(p, g, m, v)
	adamL2(p, g, m, v, c)
}

func mustSameLen4(p, g, m, v []float32) {
	mustSameLen(len(p), len(g))
	mustSameLen(len(p), len(m))
	mustSameLen(len(p), len(v))
}

// The Go loops: the whole implementation under purego and off amd64, and the tails that the
// vector kernels leave. The float32(...) conversions around products force them to be rounded
// before the addition, so no platform fuses them into FMAs. The order follows PyTorch's
// kernels: addcmul(v, g, g, value=c) = v + c*g*g, addcdiv(p, m, denom, value=-s) =
// p + (-s*m)/denom.

func adamWGeneric(p, g, m, v []float32, c *AdamConsts) {
	g, m, v = g[:len(p)], m[:len(p)], v[:len(p)] // equal lengths: no bounds checks in the loop
	b1, c1, b2, c2, eps := c.B1, c.C1, c.B2, c.C2, c.Eps
	scale, negStep, bc2Sqrt, decay := c.Scale, c.NegStep, c.BC2Sqrt, c.Decay
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

func adamL2Generic(p, g, m, v []float32, c *AdamConsts) {
	g, m, v = g[:len(p)], m[:len(p)], v[:len(p)] // equal lengths: no bounds checks in the loop
	b1, c1, b2, c2, eps, wd := c.B1, c.C1, c.B2, c.C2, c.Eps, c.WD
	scale, negStep, bc2Sqrt := c.Scale, c.NegStep, c.BC2Sqrt
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

// sqrt32 is correctly rounded: float64 carries more than twice float32's precision plus two
// bits, so rounding the float64 square root to float32 rounds only once in effect, giving
// what SQRTPS gives. The compiler turns it into a single SQRTSS.
func sqrt32(x float32) float32 { return float32(math.Sqrt(float64(x))) }
