package optim

import (
	"fmt"
	"math"

	"github.com/qvd/qvd/internal/vec"
)

// adam8 is Adam or AdamW (the same update rules as adam, see there) with both moments kept
// block-wise quantised to 8 bits (quant8.go; Dettmers et al., "8-bit Optimizers via Block-wise
// Quantization", 2022): 2 bytes per parameter plus two float32 scales per QuantBlock
// parameters, instead of adam's 8 bytes.
//
// Step works block by block: it decodes the block's m and v to float32, applies adam's
// float32 update (the same internal/vec kernel) to them and to the parameters — the parameter
// update uses the new moments before they are re-quantised, as bitsandbytes does — and
// re-quantises them with the block's new absmax. Blocks are independent, so the result does
// not depend on the thread count, and the decoded block lives on the stack (2 KiB), so Step
// does not allocate. The first step, from all-zero state, is adam's bit for bit.
//
// Its state is not float32, so State returns nil and it implements StateCodec: checkpoints
// hold the dequantised moments in float32, under adam's names, and can be resumed at any world
// size, ZeRO stage and block alignment.
type adam8 struct {
	base
	b1, b2, wd float64
	decoupled  bool
	k          adam8Pass
}

var _ StateCodec = (*adam8)(nil)

func newAdam8(cfg Config, n int) (*adam8, error) {
	blocks := (n + QuantBlock - 1) / QuantBlock
	o := &adam8{b1: cfg.Betas[0], b2: cfg.Betas[1], wd: cfg.WeightDecay, decoupled: cfg.Type == TypeAdamW8bit}
	o.k = adam8Pass{
		n:  n,
		m:  o.mem.bytes(n, "exp_avg codes"),
		v:  o.mem.bytes(n, "exp_avg_sq codes"),
		ms: o.mem.float32s(blocks, "exp_avg scales"),
		vs: o.mem.float32s(blocks, "exp_avg_sq scales"),
		c:  adamConsts(cfg),
		l2: !o.decoupled && cfg.WeightDecay != 0,
	}
	if err := o.mem.failed(); err != nil {
		return nil, err
	}
	return o, nil
}

func (o *adam8) blocks() int { return len(o.k.ms) }

func (o *adam8) Step(params, grads []float32, lr, gradScale float32) {
	o.checkStep(params, grads)
	t := o.steps.Load() + 1
	k := &o.k
	k.p, k.g = params, grads
	setStepConsts(&k.c, o.b1, o.b2, o.wd, o.decoupled, t, lr, gradScale)
	o.pool.Run(o.blocks(), max(1, o.grain/QuantBlock), k)
	k.p, k.g = nil, nil // keep no reference to the caller's buffers
	o.steps.Store(t)
}

// State is nil: the moments are not float32; see ExportState.
func (o *adam8) State() []NamedBuffer { return nil }

func (o *adam8) Close() error {
	o.k.m, o.k.v, o.k.ms, o.k.vs = nil, nil, nil, nil
	return o.close()
}

// ExportState decodes both moments into new float32 buffers named as adam's (on the Go heap:
// they are the caller's, and go when it drops them); nil after Close.
func (o *adam8) ExportState() []NamedBuffer {
	if o.closed {
		return nil
	}
	m, v := make([]float32, o.n), make([]float32, o.n)
	k := &o.k
	for b := range o.blocks() {
		lo, hi := b*QuantBlock, min((b+1)*QuantBlock, o.n)
		dequantizeBlock(m[lo:hi], k.m[lo:hi], k.ms[b], true)
		dequantizeBlock(v[lo:hi], k.v[lo:hi], k.vs[b], false)
	}
	return []NamedBuffer{{Name: "exp_avg", Data: m}, {Name: "exp_avg_sq", Data: v}}
}

// ImportState quantises float32 moments, as ExportState names them, into the state. It checks
// everything before it changes anything: a non-finite moment or a negative second moment is
// a corrupt checkpoint.
func (o *adam8) ImportState(state []NamedBuffer) error {
	if o.closed {
		return ErrClosed
	}
	if len(state) != 2 || state[0].Name != "exp_avg" || state[1].Name != "exp_avg_sq" {
		names := make([]string, len(state))
		for i, s := range state {
			names[i] = s.Name
		}
		return fmt.Errorf("optim: %s state must be [exp_avg exp_avg_sq], got %v", TypeAdamW8bit, names)
	}
	for _, s := range state {
		if len(s.Data) != o.n {
			return fmt.Errorf("optim: state %s has %d elements, the optimizer %d", s.Name, len(s.Data), o.n)
		}
		for i, x := range s.Data {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) || (s.Name == "exp_avg_sq" && x < 0) {
				return fmt.Errorf("optim: state %s[%d] = %v is not a valid moment", s.Name, i, x)
			}
		}
	}
	k := &o.k
	for b := range o.blocks() {
		lo, hi := b*QuantBlock, min((b+1)*QuantBlock, o.n)
		k.ms[b] = quantizeBlock(k.m[lo:hi], state[0].Data[lo:hi], true)
		k.vs[b] = quantizeBlock(k.v[lo:hi], state[1].Data[lo:hi], false)
	}
	return nil
}

// StateBytes counts the codes and the per-block scales.
func (o *adam8) StateBytes() int64 {
	return int64(len(o.k.m)+len(o.k.v)) + 4*int64(len(o.k.ms)+len(o.k.vs))
}

// adam8Pass is one Step's update as a Ranger over blocks.
type adam8Pass struct {
	n      int
	p, g   []float32
	m, v   []uint8   // codes, one per element
	ms, vs []float32 // absmax per block
	c      vec.AdamConsts
	l2     bool
}

func (k *adam8Pass) Range(lo, hi int) {
	for b := lo; b < hi; b++ {
		k.block(b)
	}
}

// block updates block b: decode its moments into float32 on the stack, run internal/vec's
// AdamW or AdamL2 kernel (AVX2 where the CPU has it) on them and the parameters, and encode
// them again with the block's new scales.
func (k *adam8Pass) block(b int) {
	lo, hi := b*QuantBlock, min((b+1)*QuantBlock, k.n)
	var mf, vf [QuantBlock]float32
	m, v := mf[:hi-lo], vf[:hi-lo]
	mc, vc := k.m[lo:hi], k.v[lo:hi]
	mc, vc = mc[:len(m)], vc[:len(m)] // equal lengths: no bounds checks in the loops
	am, av := k.ms[b], k.vs[b]
	sdec, udec := &signedMap.decode, &unsignedMap.decode
	for i := range m {
		m[i] = sdec[mc[i]] * am
		v[i] = udec[vc[i]] * av
	}
	if k.l2 {
		vec.AdamL2(k.p[lo:hi], k.g[lo:hi], m, v, &k.c)
	} else {
		vec.AdamW(k.p[lo:hi], k.g[lo:hi], m, v, &k.c)
	}
	// The extremes by integer maxima of the bit patterns, which order non-negative floats as
	// their values do and compile to conditional moves (float max and min must order NaN and
	// signed zeros, and branch): the largest positive m, the largest |m| of a negative m (its
	// sign bit flipped), the largest v.
	var mpos, mneg, vmax int32
	for i := range m {
		mb := int32(math.Float32bits(m[i]))
		mpos, mneg = max(mpos, mb), max(mneg, mb^math.MinInt32)
		vmax = max(vmax, int32(math.Float32bits(v[i])))
	}
	ms := signedScale(math.Float32frombits(uint32(mpos)), math.Float32frombits(uint32(mneg)))
	vs := math.Float32frombits(uint32(vmax))
	k.ms[b], k.vs[b] = ms, vs
	encodeSigned(mc, m, invAbsmax(ms))
	encodeUnsigned(vc, v, invAbsmax(vs))
}
