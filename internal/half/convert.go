package half

import "math"

// Bit-layout constants, named so the shifts below read as what they do.
const (
	signMask32 = 0x80000000
	inf32      = 0x7f800000 // float32 +Inf; any larger magnitude is a NaN
	quiet32    = 0x00400000 // float32 quiet-NaN bit (top mantissa bit)
	mantBits32 = 23

	inf16   = 0x7c00 // binary16 +Inf
	quiet16 = 0x0200 // binary16 quiet-NaN bit

	// f16Drop is the number of float32 fraction bits that binary16 does not have (23 - 10).
	f16Drop = 13
	// f16Rebias moves a float32 exponent field to binary16's: (127 - 15) << 23.
	f16Rebias = (127 - 15) << mantBits32

	// f16MinNormal is 2^-14, the smallest normal binary16, as float32 bits. Below it the result
	// is subnormal (or zero) and is rounded on a different bit position.
	f16MinNormal = 0x38800000
	// f16Overflow is 65520 as float32 bits: halfway between the largest finite binary16 (65504,
	// odd mantissa) and 2^16. Ties go to the even neighbour 2^16, which is out of range, so every
	// magnitude from here up becomes Inf.
	f16Overflow = 0x477ff000
	// f16MinSubnormalExp is the float32 exponent field of 2^-25, half the smallest binary16
	// subnormal (2^-24). Anything smaller rounds to zero; 2^-25 itself is a tie and goes to zero
	// (even) through the general rounding below.
	f16MinSubnormalExp = 127 - 25

	quietBF16 = 0x0040 // bfloat16 quiet-NaN bit
)

// F32ToF16 returns the IEEE 754 binary16 bits nearest to f, ties to even. Magnitudes of 65520
// and above become ±Inf; NaN stays NaN, made quiet, keeping the sign and the top payload bits;
// ±0 keep their sign; results in the subnormal range are rounded exactly.
func F32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	if f16IsNormal(b) {
		return f16Normal(b)
	}
	return f32ToF16Rare(b)
}

// f16IsNormal reports whether the float32 bits b convert to a normal binary16, the common case
// that the buffer loops handle inline: one unsigned compare tests
// f16MinNormal <= |b| < f16Overflow.
func f16IsNormal(b uint32) bool {
	return b&^signMask32-f16MinNormal < f16Overflow-f16MinNormal
}

// f16Normal converts float32 bits b for which f16IsNormal holds.
func f16Normal(b uint32) uint16 {
	// Rebias the exponent, then round to nearest even on the 13 dropped bits: add just under
	// half an ulp, plus one more when the kept lsb is odd. A carry out of the mantissa
	// correctly bumps the exponent; it cannot reach the Inf encoding because |b| < f16Overflow.
	a := b&^signMask32 - f16Rebias
	a += 1<<(f16Drop-1) - 1 + (a>>f16Drop)&1
	return uint16(b>>16)&0x8000 | uint16(a>>f16Drop)
}

// f32ToF16Rare converts the values outside binary16's normal range: zero, subnormal results,
// overflow to Inf, Inf and NaN.
func f32ToF16Rare(b uint32) uint16 {
	sign := uint16(b>>16) & 0x8000
	a := b &^ signMask32
	switch {
	case a > inf32:
		// Setting the quiet bit also keeps a NaN whose payload lived only in the dropped low
		// bits from reading back as Inf.
		return sign | inf16 | quiet16 | uint16(a>>f16Drop)&0x03ff
	case a >= f16Overflow:
		return sign | inf16
	}
	return sign | f16Subnormal(a)
}

// f16Subnormal rounds a magnitude below 2^-14 (float32 bits a) to a binary16 subnormal, which
// counts units of 2^-24. A carry may produce 0x0400, the smallest normal, which is the correct
// encoding of a value that rounds up to 2^-14.
func f16Subnormal(a uint32) uint16 {
	e := a >> mantBits32
	if e < f16MinSubnormalExp {
		return 0
	}
	m := a&(1<<mantBits32-1) | 1<<mantBits32 // significand with its implicit bit
	// a's value is m * 2^(e-150); in units of 2^-24 that is m >> (126-e), with 14 <= shift <= 24.
	s := (126 - e) & 31
	m += 1<<(s-1) - 1 + (m>>s)&1
	return uint16(m >> s)
}

// F16ToF32 returns the float32 equal to the binary16 bits h; every binary16 value is exact in
// float32. NaNs are returned quiet with their payload, as hardware conversions do.
func F16ToF32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	em := uint32(h & 0x7fff) // exponent and mantissa
	b := em<<f16Drop + f16Rebias
	if em >= inf16 {
		// Exponent all ones: move it to float32's all-ones exponent.
		b += f16Rebias
		if em > inf16 {
			b |= quiet32
		}
	}
	if em < 1<<10 {
		// Zero or subnormal: the mantissa counts units of 2^-24. An integer conversion and a
		// multiply by a power of two are exact here and avoid normalising bit by bit.
		b = math.Float32bits(float32(int32(em)) * 0x1p-24)
	}
	return math.Float32frombits(sign | b)
}

// F32ToBF16 returns the bfloat16 bits nearest to f, ties to even: the upper 16 bits of f after
// rounding on the lower 16. Finite values too large for bfloat16 round to ±Inf as IEEE
// rounding requires. NaN stays NaN, made quiet, keeping the sign and the top payload bits:
// rounding a NaN could carry into the exponent and turn it into Inf, so it is truncated.
func F32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&^signMask32 > inf32 {
		return uint16(b>>16) | quietBF16
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// BF16ToF32 returns the float32 equal to the bfloat16 bits h (exact: bfloat16 is the upper
// half of a float32).
func BF16ToF32(h uint16) float32 {
	return math.Float32frombits(uint32(h) << 16)
}
