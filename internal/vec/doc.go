// Package vec holds the element-wise float32 kernels of qvd's hot loops: the collectives add
// received pieces into fp32 buffers (Add, AddDecodedF16, AddDecodedBF16), average them
// (AddScale, Scale), and move fp16/bf16 words on the wire (EncodeF16, DecodeF16,
// EncodeBF16); the optimizer and gradient clipping take norms (SumSquares) and maxima (Max);
// the CPU optimizer steps Adam and AdamW over its shard (AdamW, AdamL2).
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// On amd64 CPUs with AVX2 and F16C the kernels are assembly (vec_amd64.s), chosen at run time
// with golang.org/x/sys/cpu; elsewhere, and everywhere under the build tag purego, they are
// plain Go loops. Accelerated reports which is in use.
//
// # Contract
//
// The caller owns every buffer and passes the output first. dst and src must have the same
// length; a mismatch is a programmer error and panics. dst and src may be the same slice, but
// must not otherwise overlap. Nothing allocates. Every function is safe for concurrent use on
// disjoint buffers.
//
// # Identical bits on every CPU
//
// Ranks of one job may run on different CPUs and builds, and must agree bit for bit:
//
//   - EncodeF16, DecodeF16, EncodeBF16 and the conversions inside AddDecodedF16 and
//     AddDecodedBF16 are bit-identical to internal/half's scalar functions for every input,
//     NaN payloads, subnormals, ±0 and overflow to ±Inf included. F16C's conversions round to
//     nearest even and treat NaNs exactly as internal/half does, so they need no fix-up path;
//     this was checked on all 2^32 float32 words (TestEncodeSweep, run with -vec.sweep).
//   - Add, AddScale, Scale and the additions in AddDecoded* are single IEEE float32
//     operations, so their results are the same everywhere, except for which NaN comes out
//     when both operands are NaNs: that choice is the hardware's (x86 returns the first
//     operand, arm64 prefers a signalling NaN). A single NaN operand comes out made quiet on
//     every CPU.
//   - AdamW and AdamL2 are sequences of single IEEE float32 operations (multiply, add,
//     divide, square root; never a fused multiply-add) in a fixed order, so the same holds
//     for them; TestAdamGolden pins their bits.
//   - Max has the builtin max's semantics, and its NaN results are pinned down too: when the
//     operands are equal or either is a NaN, the result has the OR of their bits with the sign
//     bit of their AND. That is exactly what the builtin compiles to on amd64.
//   - SumSquares follows the fixed definition below in every implementation.
//
// The kernels assume MXCSR as Go leaves it (round to nearest, no flush-to-zero, no
// denormals-are-zero), which is also what the Go loops compute under; the F16C conversions set
// their rounding mode in the instruction.
//
// # SumSquares
//
// SumSquares(x) is defined as follows, and every implementation computes exactly this:
//
//  1. Eight float64 lane sums p[0..7] start at +0. Element x[i] belongs to lane i%8, and each
//     lane adds float64(x[i])*float64(x[i]) to its sum in increasing i. (The product of two
//     float32 values is exact in float64, so a fused multiply-add gives the same result as a
//     multiply and an add.)
//  2. The result is ((p0+p4) + (p2+p6)) + ((p1+p5) + (p3+p7)), which is the order in which
//     the halves of two 4-wide vector registers reduce.
//  3. If that is a NaN (some x[i] was a NaN), the result is math.NaN(), one canonical word,
//     because which NaN an addition propagates differs between CPUs. A ±Inf element without a
//     NaN gives +Inf; squares are never negative, so no Inf-Inf arises.
//
// Eight lanes let the vector kernel keep two independent 4-wide chains of additions, close to
// the rate at which one core can widen float32 to float64, while the Go loop keeps all eight sums in
// registers. Float64 accumulation makes the result accurate to far below float32 resolution
// for any buffer length qvd uses.
package vec
