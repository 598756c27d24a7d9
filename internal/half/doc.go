// Package half converts between float32 and the two 16-bit floating-point formats qvd trains
// with: IEEE 754 binary16 ("fp16") and bfloat16 ("bf16").
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// Mixed-precision training keeps fp32 master weights; the model computes on weights rounded to
// the working format, gradients are rounded to it, and the collectives put 16-bit words on the
// wire (Micikevicius et al., "Mixed Precision Training", 2018). This package owns the
// arithmetic of that rounding and nothing else:
//
//   - Format names the working precision of a run (the config's `precision:` key) and rounds
//     values through it (Round, RoundSlice) so fp32 code can simulate the format exactly.
//   - F32ToF16/F16ToF32 and F32ToBF16/BF16ToF32 convert one value, bit-exactly: round to nearest,
//     ties to even; fp16 overflow goes to ±Inf; NaN stays NaN (quiet); ±0 and subnormals are kept.
//   - Encode*/Decode* convert whole buffers into caller-owned outputs (dst first), and
//     AddDecoded* accumulate decoded words into an fp32 sum, which is how a reduction adds
//     16-bit words received from a peer without losing precision in the sum.
//
// The buffer functions run over whole gradient buffers every step, so they allocate nothing and
// are written so the compiler drops bounds checks inside the loops. Their dst and src must have
// the same length; a mismatch is a programmer error and panics, as in gonum's floats package.
//
// Everything here is a pure function of its arguments and safe for concurrent use; the buffer
// functions may run concurrently on disjoint slices. DecodeF16 and AddDecodedF16 look words up
// in a 256 KiB table built once, on first use, under a sync.OnceValue.
package half
