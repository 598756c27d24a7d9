//go:build amd64 && !purego

#include "go_asm.h"
#include "textflag.h"

// AVX2 kernels for vec_amd64.go. Each takes a count n that is a multiple of 8 (possibly zero)
// and works on 32 elements per iteration while at least 32 remain, then on 8. Loads and stores
// are unaligned (VMOVUPS): callers pass arbitrary sub-slices of flat buffers. A start that is
// not 32-byte aligned splits every other access across two cache lines; that cost up to 1.7x
// on buffers in L1 and nothing measurable on larger ones, so the kernels do not peel to align.
//
// Go's assembler writes AVX operands in reverse Intel order: "VADDPS Y1, Y0, Y2" is Intel's
// "vaddps ymm2, ymm0, ymm1". Where it matters for NaNs (x86 returns the first source's NaN
// when both are NaN) the first source is dst, which is also what the Go compiler currently
// emits for the Go loops.
//
// Every vector instruction is VEX-encoded, and every kernel ends with VZEROUPPER, so that no
// legacy SSE instruction meets a dirty upper state: loading the bfloat16 constants with the
// SSE form of MOVQ once cost about 1 µs per call (measured on Sapphire Rapids).

// func addAVX2(dst, src *float32, n int)
TEXT ·addAVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	CMPQ CX, $32
	JB   add8

add32:
	VMOVUPS (DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	VADDPS  (SI), Y0, Y0
	VADDPS  32(SI), Y1, Y1
	VADDPS  64(SI), Y2, Y2
	VADDPS  96(SI), Y3, Y3
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, SI
	SUBQ    $32, CX
	CMPQ    CX, $32
	JAE     add32

add8:
	TESTQ CX, CX
	JZ    addDone

add8Loop:
	VMOVUPS (DI), Y0
	VADDPS  (SI), Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ    $32, DI
	ADDQ    $32, SI
	SUBQ    $8, CX
	JNZ     add8Loop

addDone:
	VZEROUPPER
	RET

// func addScaleAVX2(dst, src *float32, n int, s float32)
TEXT ·addScaleAVX2(SB), NOSPLIT, $0-28
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	VBROADCASTSS s+24(FP), Y8
	CMPQ         CX, $32
	JB           addScale8

addScale32:
	VMOVUPS (DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS 64(DI), Y2
	VMOVUPS 96(DI), Y3
	VADDPS  (SI), Y0, Y0
	VADDPS  32(SI), Y1, Y1
	VADDPS  64(SI), Y2, Y2
	VADDPS  96(SI), Y3, Y3
	VMULPS  Y8, Y0, Y0
	VMULPS  Y8, Y1, Y1
	VMULPS  Y8, Y2, Y2
	VMULPS  Y8, Y3, Y3
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	ADDQ    $128, SI
	SUBQ    $32, CX
	CMPQ    CX, $32
	JAE     addScale32

addScale8:
	TESTQ CX, CX
	JZ    addScaleDone

addScale8Loop:
	VMOVUPS (DI), Y0
	VADDPS  (SI), Y0, Y0
	VMULPS  Y8, Y0, Y0
	VMOVUPS Y0, (DI)
	ADDQ    $32, DI
	ADDQ    $32, SI
	SUBQ    $8, CX
	JNZ     addScale8Loop

addScaleDone:
	VZEROUPPER
	RET

// func scaleAVX2(x *float32, n int, s float32)
TEXT ·scaleAVX2(SB), NOSPLIT, $0-20
	MOVQ         x+0(FP), DI
	MOVQ         n+8(FP), CX
	VBROADCASTSS s+16(FP), Y8
	CMPQ         CX, $32
	JB           scale8

scale32:
	VMULPS  (DI), Y8, Y0
	VMULPS  32(DI), Y8, Y1
	VMULPS  64(DI), Y8, Y2
	VMULPS  96(DI), Y8, Y3
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	VMOVUPS Y2, 64(DI)
	VMOVUPS Y3, 96(DI)
	ADDQ    $128, DI
	SUBQ    $32, CX
	CMPQ    CX, $32
	JAE     scale32

scale8:
	TESTQ CX, CX
	JZ    scaleDone

scale8Loop:
	VMULPS  (DI), Y8, Y0
	VMOVUPS Y0, (DI)
	ADDQ    $32, DI
	SUBQ    $8, CX
	JNZ     scale8Loop

scaleDone:
	VZEROUPPER
	RET

// MAX8 computes max32 (generic.go) on the 8 lanes of x (dst) and y (src) into x, with the
// same sequence the Go compiler emits for the builtin on amd64: max(x, y) = -min(-x, -y),
// where min(a, b) = t1 | t2 with t1 = (a < b ? a : b) and t2 = (t1 < a ? t1 : a). MINPS
// returns its second source when either is a NaN or both are equal, so t1|t2 is the OR of
// the two inputs in exactly the equal-or-unordered cases; negating both sides turns the OR
// of the sign bits into their AND. Y14 holds the sign mask; t and u are scratch.
#define MAX8(x, y, t, u) \
	VXORPS Y14, x, x; \
	VXORPS Y14, y, y; \
	VMINPS y, x, t; \
	VMINPS x, t, u; \
	VORPS  u, t, t; \
	VXORPS Y14, t, x

// func maxAVX2(dst, src *float32, n int)
TEXT ·maxAVX2(SB), NOSPLIT, $0-24
	MOVQ     dst+0(FP), DI
	MOVQ     src+8(FP), SI
	MOVQ     n+16(FP), CX
	VPCMPEQD Y14, Y14, Y14
	VPSLLD   $31, Y14, Y14 // 0x80000000 in every lane
	CMPQ     CX, $16
	JB       max8

max16:
	VMOVUPS (DI), Y0
	VMOVUPS 32(DI), Y1
	VMOVUPS (SI), Y2
	VMOVUPS 32(SI), Y3
	MAX8(Y0, Y2, Y4, Y5)
	MAX8(Y1, Y3, Y6, Y7)
	VMOVUPS Y0, (DI)
	VMOVUPS Y1, 32(DI)
	ADDQ    $64, DI
	ADDQ    $64, SI
	SUBQ    $16, CX
	CMPQ    CX, $16
	JAE     max16

max8:
	TESTQ CX, CX
	JZ    maxDone
	VMOVUPS (DI), Y0
	VMOVUPS (SI), Y2
	MAX8(Y0, Y2, Y4, Y5)
	VMOVUPS Y0, (DI)

maxDone:
	VZEROUPPER
	RET

// func sumSquaresAVX2(x *float32, n int, p *[8]float64)
//
// Lane k of SumSquares's definition (element i goes to lane i%8) lives in lane k%4 of Y0
// (k < 4) or of Y1 (k >= 4): each group of 8 floats is widened to two vectors of 4 doubles,
// squared, and added to the two accumulators, so every lane adds its elements in index order.
// The square of a widened float32 is exact, so this rounds exactly as the Go loop does (and
// as an FMA would). A separate multiply and add is faster than an FMA here: the loop is bound
// by the latency of the two accumulator chains, and an add's latency is shorter (2-3 cycles
// on Golden Cove and Zen, against 4 for an FMA; the same 4 on Skylake).
//
// The loop reads one stream and does little work per byte, and the hardware prefetcher alone
// does not keep enough lines in flight for it: prefetching 2 KiB ahead (32 lines) took 16M
// elements from 7.5 to 10.3 GB/s on a Sapphire Rapids core. The other kernels touch two or
// three streams and showed no gain from it.
#define PREFETCH_AHEAD 2048

TEXT ·sumSquaresAVX2(SB), NOSPLIT, $0-24
	MOVQ    x+0(FP), SI
	MOVQ    n+8(FP), CX
	MOVQ    p+16(FP), DX
	VMOVUPD (DX), Y0
	VMOVUPD 32(DX), Y1
	CMPQ    CX, $32
	JB      sumSquares8

sumSquares32:
	PREFETCHT0 PREFETCH_AHEAD(SI)
	PREFETCHT0 (PREFETCH_AHEAD+64)(SI)
	VCVTPS2PD  (SI), Y2
	VCVTPS2PD  16(SI), Y3
	VCVTPS2PD  32(SI), Y4
	VCVTPS2PD  48(SI), Y5
	VCVTPS2PD  64(SI), Y6
	VCVTPS2PD  80(SI), Y7
	VCVTPS2PD  96(SI), Y8
	VCVTPS2PD  112(SI), Y9
	VMULPD     Y2, Y2, Y2
	VMULPD     Y3, Y3, Y3
	VMULPD     Y4, Y4, Y4
	VMULPD     Y5, Y5, Y5
	VMULPD     Y6, Y6, Y6
	VMULPD     Y7, Y7, Y7
	VMULPD     Y8, Y8, Y8
	VMULPD     Y9, Y9, Y9
	VADDPD     Y2, Y0, Y0
	VADDPD     Y3, Y1, Y1
	VADDPD     Y4, Y0, Y0
	VADDPD     Y5, Y1, Y1
	VADDPD     Y6, Y0, Y0
	VADDPD     Y7, Y1, Y1
	VADDPD     Y8, Y0, Y0
	VADDPD     Y9, Y1, Y1
	ADDQ       $128, SI
	SUBQ       $32, CX
	CMPQ       CX, $32
	JAE        sumSquares32

sumSquares8:
	TESTQ CX, CX
	JZ    sumSquaresDone

sumSquares8Loop:
	VCVTPS2PD (SI), Y2
	VCVTPS2PD 16(SI), Y3
	VMULPD    Y2, Y2, Y2
	VMULPD    Y3, Y3, Y3
	VADDPD    Y2, Y0, Y0
	VADDPD    Y3, Y1, Y1
	ADDQ      $32, SI
	SUBQ      $8, CX
	JNZ       sumSquares8Loop

sumSquaresDone:
	VMOVUPD Y0, (DX)
	VMOVUPD Y1, 32(DX)
	VZEROUPPER
	RET

// func encodeF16F16C(dst *uint16, src *float32, n int)
//
// VCVTPS2PH with immediate 0 rounds to nearest even, exactly as half.F32ToF16, including
// subnormal results and overflow to Inf (the immediate overrides MXCSR's rounding mode; Go
// leaves MXCSR's FTZ and DAZ off). A NaN comes out quiet with the sign and the top ten
// payload bits, which is also half's rule; the tests check every exponent and NaN payloads.
TEXT ·encodeF16F16C(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	CMPQ CX, $32
	JB   encodeF168

encodeF1632:
	VMOVUPS   (SI), Y0
	VMOVUPS   32(SI), Y1
	VMOVUPS   64(SI), Y2
	VMOVUPS   96(SI), Y3
	VCVTPS2PH $0, Y0, (DI)
	VCVTPS2PH $0, Y1, 16(DI)
	VCVTPS2PH $0, Y2, 32(DI)
	VCVTPS2PH $0, Y3, 48(DI)
	ADDQ      $64, DI
	ADDQ      $128, SI
	SUBQ      $32, CX
	CMPQ      CX, $32
	JAE       encodeF1632

encodeF168:
	TESTQ CX, CX
	JZ    encodeF16Done

encodeF168Loop:
	VMOVUPS   (SI), Y0
	VCVTPS2PH $0, Y0, (DI)
	ADDQ      $16, DI
	ADDQ      $32, SI
	SUBQ      $8, CX
	JNZ       encodeF168Loop

encodeF16Done:
	VZEROUPPER
	RET

// func decodeF16F16C(dst *float32, src *uint16, n int)
//
// VCVTPH2PS is exact and keeps subnormals (MXCSR's DAZ does not apply to it); a NaN comes out
// quiet with its payload, as half.F16ToF32 does.
TEXT ·decodeF16F16C(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	CMPQ CX, $32
	JB   decodeF168

decodeF1632:
	VCVTPH2PS (SI), Y0
	VCVTPH2PS 16(SI), Y1
	VCVTPH2PS 32(SI), Y2
	VCVTPH2PS 48(SI), Y3
	VMOVUPS   Y0, (DI)
	VMOVUPS   Y1, 32(DI)
	VMOVUPS   Y2, 64(DI)
	VMOVUPS   Y3, 96(DI)
	ADDQ      $128, DI
	ADDQ      $64, SI
	SUBQ      $32, CX
	CMPQ      CX, $32
	JAE       decodeF1632

decodeF168:
	TESTQ CX, CX
	JZ    decodeF16Done

decodeF168Loop:
	VCVTPH2PS (SI), Y0
	VMOVUPS   Y0, (DI)
	ADDQ      $32, DI
	ADDQ      $16, SI
	SUBQ      $8, CX
	JNZ       decodeF168Loop

decodeF16Done:
	VZEROUPPER
	RET

// func addDecodedF16F16C(dst *float32, src *uint16, n int)
TEXT ·addDecodedF16F16C(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	CMPQ CX, $32
	JB   addDecodedF168

addDecodedF1632:
	VCVTPH2PS (SI), Y4
	VCVTPH2PS 16(SI), Y5
	VCVTPH2PS 32(SI), Y6
	VCVTPH2PS 48(SI), Y7
	VMOVUPS   (DI), Y0
	VMOVUPS   32(DI), Y1
	VMOVUPS   64(DI), Y2
	VMOVUPS   96(DI), Y3
	VADDPS    Y4, Y0, Y0
	VADDPS    Y5, Y1, Y1
	VADDPS    Y6, Y2, Y2
	VADDPS    Y7, Y3, Y3
	VMOVUPS   Y0, (DI)
	VMOVUPS   Y1, 32(DI)
	VMOVUPS   Y2, 64(DI)
	VMOVUPS   Y3, 96(DI)
	ADDQ      $128, DI
	ADDQ      $64, SI
	SUBQ      $32, CX
	CMPQ      CX, $32
	JAE       addDecodedF1632

addDecodedF168:
	TESTQ CX, CX
	JZ    addDecodedF16Done

addDecodedF168Loop:
	VCVTPH2PS (SI), Y4
	VMOVUPS   (DI), Y0
	VADDPS    Y4, Y0, Y0
	VMOVUPS   Y0, (DI)
	ADDQ      $32, DI
	ADDQ      $16, SI
	SUBQ      $8, CX
	JNZ       addDecodedF168Loop

addDecodedF16Done:
	VZEROUPPER
	RET

// BF16ROUND turns the 8 float32 words in v into their bfloat16 encodings, one per 32-bit
// lane, as half.F32ToBF16 does: (v + 0x7fff + lsb) >> 16 rounds to nearest even (lsb is bit
// 16, the lowest kept bit; the carry may correctly run into the exponent and reach Inf), and
// a NaN is truncated instead, so it cannot round into Inf, and made quiet: (v >> 16) | 0x40.
// Constants: Y9 = 0x40, Y10 = 0x7fff, Y11 = 1, Y12 = 0x7f800000, Y13 = 0x7fffffff. t and u
// are scratch. A NaN is |v| > Inf as a signed compare, valid because |v| < 2^31.
#define BF16ROUND(v, t, u) \
	VPAND    Y13, v, t; \
	VPCMPGTD Y12, t, t; \
	VPSRLD   $16, v, u; \
	VPAND    Y11, u, u; \
	VPADDD   Y10, u, u; \
	VPANDN   u, t, u; \
	VPADDD   u, v, v; \
	VPSRLD   $16, v, v; \
	VPAND    Y9, t, t; \
	VPOR     t, v, v

// func encodeBF16AVX2(dst *uint16, src *float32, n int)
TEXT ·encodeBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ         dst+0(FP), DI
	MOVQ         src+8(FP), SI
	MOVQ         n+16(FP), CX
	MOVL         $0x40, AX
	VMOVD        AX, X9
	VPBROADCASTD X9, Y9
	MOVL         $0x7fff, AX
	VMOVD        AX, X10
	VPBROADCASTD X10, Y10
	MOVL         $1, AX
	VMOVD        AX, X11
	VPBROADCASTD X11, Y11
	MOVL         $0x7f800000, AX
	VMOVD        AX, X12
	VPBROADCASTD X12, Y12
	MOVL         $0x7fffffff, AX
	VMOVD        AX, X13
	VPBROADCASTD X13, Y13
	CMPQ         CX, $16
	JB           encodeBF168

encodeBF1616:
	VMOVDQU (SI), Y0
	VMOVDQU 32(SI), Y1
	BF16ROUND(Y0, Y2, Y3)
	BF16ROUND(Y1, Y4, Y5)

	// The words fit in 16 bits, so the unsigned saturation of VPACKUSDW never applies. It
	// packs within 128-bit halves (0-3 of Y0, 0-3 of Y1, 4-7 of Y0, 4-7 of Y1); the
	// quadword permutation 0, 2, 1, 3 puts the halves back in order.
	VPACKUSDW Y1, Y0, Y0
	VPERMQ    $0xd8, Y0, Y0
	VMOVDQU   Y0, (DI)
	ADDQ      $32, DI
	ADDQ      $64, SI
	SUBQ      $16, CX
	CMPQ      CX, $16
	JAE       encodeBF1616

encodeBF168:
	TESTQ CX, CX
	JZ    encodeBF16Done
	VMOVDQU      (SI), Y0
	BF16ROUND(Y0, Y2, Y3)
	VEXTRACTI128 $1, Y0, X1
	VPACKUSDW    X1, X0, X0
	VMOVDQU      X0, (DI)

encodeBF16Done:
	VZEROUPPER
	RET

// func addDecodedBF16AVX2(dst *float32, src *uint16, n int)
//
// A bfloat16 word is the upper half of its float32: zero-extend and shift left 16.
TEXT ·addDecodedBF16AVX2(SB), NOSPLIT, $0-24
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	CMPQ CX, $32
	JB   addDecodedBF168

addDecodedBF1632:
	VPMOVZXWD (SI), Y4
	VPMOVZXWD 16(SI), Y5
	VPMOVZXWD 32(SI), Y6
	VPMOVZXWD 48(SI), Y7
	VPSLLD    $16, Y4, Y4
	VPSLLD    $16, Y5, Y5
	VPSLLD    $16, Y6, Y6
	VPSLLD    $16, Y7, Y7
	VMOVUPS   (DI), Y0
	VMOVUPS   32(DI), Y1
	VMOVUPS   64(DI), Y2
	VMOVUPS   96(DI), Y3
	VADDPS    Y4, Y0, Y0
	VADDPS    Y5, Y1, Y1
	VADDPS    Y6, Y2, Y2
	VADDPS    Y7, Y3, Y3
	VMOVUPS   Y0, (DI)
	VMOVUPS   Y1, 32(DI)
	VMOVUPS   Y2, 64(DI)
	VMOVUPS   Y3, 96(DI)
	ADDQ      $128, DI
	ADDQ      $64, SI
	SUBQ      $32, CX
	CMPQ      CX, $32
	JAE       addDecodedBF1632

addDecodedBF168:
	TESTQ CX, CX
	JZ    addDecodedBF16Done

addDecodedBF168Loop:
	VPMOVZXWD (SI), Y4
	VPSLLD    $16, Y4, Y4
	VMOVUPS   (DI), Y0
	VADDPS    Y4, Y0, Y0
	VMOVUPS   Y0, (DI)
	ADDQ      $32, DI
	ADDQ      $16, SI
	SUBQ      $8, CX
	JNZ       addDecodedBF168Loop

addDecodedBF16Done:
	VZEROUPPER
	RET

// The Adam kernels (AdamW, AdamL2) do the Go loops' operations in the same order, each a
// separate VMULPS, VADDPS, VDIVPS or VSQRTPS — never an FMA, whose single rounding would change
// the bits. They work on 16 elements per iteration while at least 16 remain, then on 8: two
// blocks of three registers each, with the nine broadcast constants held in Y6-Y14. A step is
// bound by memory traffic (28 bytes per element), and the two VDIVPS and one VSQRTPS per block
// keep a core's divider busy about 2 cycles per element, so wider registers would not help.
//
// Base pointers p, g, m, v in DI, SI, R8, R9; BX is the byte offset shared by all four.
// Constants: Y6 b1, Y7 c1, Y8 b2, Y9 c2, Y10 eps, Y11 scale, Y12 negStep, Y13 bc2Sqrt, Y14 decay
// (AdamW) or wd (AdamL2).

#define ADAM_CONSTS(c) \
	VBROADCASTSS AdamConsts_B1(c), Y6; \
	VBROADCASTSS AdamConsts_C1(c), Y7; \
	VBROADCASTSS AdamConsts_B2(c), Y8; \
	VBROADCASTSS AdamConsts_C2(c), Y9; \
	VBROADCASTSS AdamConsts_Eps(c), Y10; \
	VBROADCASTSS AdamConsts_Scale(c), Y11; \
	VBROADCASTSS AdamConsts_NegStep(c), Y12; \
	VBROADCASTSS AdamConsts_BC2Sqrt(c), Y13

// ADAM_MOMENTS takes g' in G and updates the 8 moments at byte offset off: m = b1*m + c1*g'
// into M and stored, v = b2*v + (c2*g')*g' stored, and leaves the step (negStep*m)/denom in M,
// with denom = sqrt(v)/bc2Sqrt + eps. G and T are clobbered.
#define ADAM_MOMENTS(off, G, M, T) \
	VMULPS  off(R8)(BX*1), Y6, M; \
	VMULPS  G, Y7, T; \
	VADDPS  T, M, M; \
	VMOVUPS M, off(R8)(BX*1); \
	VMULPS  G, Y9, T; \
	VMULPS  G, T, T; \
	VMULPS  off(R9)(BX*1), Y8, G; \
	VADDPS  T, G, G; \
	VMOVUPS G, off(R9)(BX*1); \
	VSQRTPS G, G; \
	VDIVPS  Y13, G, G; \
	VADDPS  Y10, G, G; \
	VMULPS  M, Y12, M; \
	VDIVPS  G, M, M

// ADAMW_BLOCK: g' = g*scale; p = p*decay + step.
#define ADAMW_BLOCK(off, G, M, T) \
	VMULPS  off(SI)(BX*1), Y11, G; \
	ADAM_MOMENTS(off, G, M, T); \
	VMULPS  off(DI)(BX*1), Y14, T; \
	VADDPS  M, T, T; \
	VMOVUPS T, off(DI)(BX*1)

// ADAML2_BLOCK: g' = g*scale + wd*p; p = p + step.
#define ADAML2_BLOCK(off, G, M, T) \
	VMULPS  off(SI)(BX*1), Y11, G; \
	VMULPS  off(DI)(BX*1), Y14, T; \
	VADDPS  T, G, G; \
	ADAM_MOMENTS(off, G, M, T); \
	VMOVUPS off(DI)(BX*1), T; \
	VADDPS  M, T, T; \
	VMOVUPS T, off(DI)(BX*1)

// func adamWAVX2(p, grad, m, v *float32, n int, c *AdamConsts)
TEXT ·adamWAVX2(SB), NOSPLIT, $0-48
	MOVQ         p+0(FP), DI
	MOVQ         grad+8(FP), SI
	MOVQ         m+16(FP), R8
	MOVQ         v+24(FP), R9
	MOVQ         n+32(FP), CX
	MOVQ         c+40(FP), AX
	ADAM_CONSTS(AX)
	VBROADCASTSS AdamConsts_Decay(AX), Y14
	SHLQ         $2, CX       // bytes
	MOVQ         CX, DX
	ANDQ         $-64, DX     // bytes in whole 16-element blocks
	XORQ         BX, BX
	TESTQ        DX, DX
	JZ           adamW8

adamW16:
	ADAMW_BLOCK(0, Y0, Y1, Y2)
	ADAMW_BLOCK(32, Y3, Y4, Y5)
	ADDQ $64, BX
	CMPQ BX, DX
	JB   adamW16

adamW8:
	CMPQ BX, CX
	JAE  adamWDone
	ADAMW_BLOCK(0, Y0, Y1, Y2)

adamWDone:
	VZEROUPPER
	RET

// func adamL2AVX2(p, grad, m, v *float32, n int, c *AdamConsts)
TEXT ·adamL2AVX2(SB), NOSPLIT, $0-48
	MOVQ         p+0(FP), DI
	MOVQ         grad+8(FP), SI
	MOVQ         m+16(FP), R8
	MOVQ         v+24(FP), R9
	MOVQ         n+32(FP), CX
	MOVQ         c+40(FP), AX
	ADAM_CONSTS(AX)
	VBROADCASTSS AdamConsts_WD(AX), Y14
	SHLQ         $2, CX
	MOVQ         CX, DX
	ANDQ         $-64, DX
	XORQ         BX, BX
	TESTQ        DX, DX
	JZ           adamL28

adamL216:
	ADAML2_BLOCK(0, Y0, Y1, Y2)
	ADAML2_BLOCK(32, Y3, Y4, Y5)
	ADDQ $64, BX
	CMPQ BX, DX
	JB   adamL216

adamL28:
	CMPQ BX, CX
	JAE  adamL2Done
	ADAML2_BLOCK(0, Y0, Y1, Y2)

adamL2Done:
	VZEROUPPER
	RET
