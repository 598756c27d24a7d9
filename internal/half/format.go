package half

import (
	"errors"
	"fmt"
	"math"
	"strings"
)

// Format is the working precision of a training run: the config's `precision:` key.
type Format uint8

// The formats qvd trains in. FP32 is the zero value so an unset precision means full precision.
const (
	FP32 Format = iota // IEEE 754 binary32: no rounding
	FP16               // IEEE 754 binary16: 5 exponent bits, 10 fraction bits; needs loss scaling
	BF16               // bfloat16: float32's 8 exponent bits, 7 fraction bits
)

// ErrUnknownFormat is returned (wrapped) by ParseFormat and UnmarshalText for a name that is
// not a known precision.
var ErrUnknownFormat = errors.New("unknown precision")

// ParseFormat returns the Format named by s: "fp32", "fp16" or "bf16", or the aliases
// "float32", "float16", "half" and "bfloat16". Case and surrounding space are ignored.
func ParseFormat(s string) (Format, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "fp32", "float32":
		return FP32, nil
	case "fp16", "float16", "half":
		return FP16, nil
	case "bf16", "bfloat16":
		return BF16, nil
	}
	return FP32, fmt.Errorf("parse precision %q: %w (want fp32, fp16 or bf16)", s, ErrUnknownFormat)
}

// String returns the canonical name ("fp32", "fp16", "bf16"), which ParseFormat accepts.
func (f Format) String() string {
	switch f {
	case FP32:
		return "fp32"
	case FP16:
		return "fp16"
	case BF16:
		return "bf16"
	}
	return fmt.Sprintf("Format(%d)", uint8(f))
}

// MarshalText implements encoding.TextMarshaler so configs write the canonical name.
func (f Format) MarshalText() ([]byte, error) {
	if !f.valid() {
		return nil, fmt.Errorf("marshal precision %d: %w", uint8(f), ErrUnknownFormat)
	}
	return []byte(f.String()), nil
}

// UnmarshalText implements encoding.TextUnmarshaler so YAML and JSON configs can hold a
// Format directly (`precision: bf16`).
func (f *Format) UnmarshalText(text []byte) error {
	v, err := ParseFormat(string(text))
	if err != nil {
		return err
	}
	*f = v
	return nil
}

func (f Format) valid() bool { return f <= BF16 }

// Bytes is the size of one element in the format: 4, 2 or 2 (0 for an unknown Format).
func (f Format) Bytes() int {
	switch f {
	case FP32:
		return 4
	case FP16, BF16:
		return 2
	}
	return 0
}

// MaxFinite is the largest finite value of the format: 3.4028235e38, 65504 or 3.3895314e38.
// Loss scaling uses it to judge how far a gradient can be scaled up before it overflows.
func (f Format) MaxFinite() float32 {
	switch f {
	case FP16:
		return 65504
	case BF16:
		return math.Float32frombits(0x7f7f0000)
	}
	return math.MaxFloat32
}

// Round returns x after a round trip through the format: the value the format stores for x.
// It is the identity for FP32 (and for an unknown Format).
func (f Format) Round(x float32) float32 {
	switch f {
	case FP16:
		return F16ToF32(F32ToF16(x))
	case BF16:
		return BF16ToF32(F32ToBF16(x))
	}
	return x
}

// RoundSlice replaces every element of x with f.Round of it, in place and without allocating.
// The model calls it on its weights before the forward pass and on each gradient, so the fp32
// graph computes on exactly the values the format can hold.
func (f Format) RoundSlice(x []float32) {
	// The switch sits outside the loops so each loop body is a straight-line conversion.
	switch f {
	case FP16:
		for i, v := range x {
			b := math.Float32bits(v)
			if f16IsNormal(b) {
				// A normal binary16 result can be rounded without leaving float32: round to
				// nearest even at the 13th fraction bit and clear the bits below it.
				b += 1<<(f16Drop-1) - 1 + (b>>f16Drop)&1
				x[i] = math.Float32frombits(b &^ (1<<f16Drop - 1))
			} else {
				x[i] = F16ToF32(f32ToF16Rare(b))
			}
		}
	case BF16:
		for i, v := range x {
			x[i] = BF16ToF32(F32ToBF16(v))
		}
	}
}
