package collective

import (
	"encoding/binary"
	"fmt"
	"unsafe"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// DType is the element type of a data frame's payload (Header.DType). The float types keep
// half.Format's codes, so their frames are what they were before the typed collectives; the
// exact types carry AllReduceInt64's and BroadcastBytes' elements, so that integers and
// flags never travel as floats.
type DType uint8

// Element types on the wire.
const (
	DTypeFP32  = DType(half.FP32)
	DTypeFP16  = DType(half.FP16)
	DTypeBF16  = DType(half.BF16)
	DTypeInt64 = DType(16) // little-endian two's complement
	DTypeUint8 = DType(17) // raw bytes
)

// WireDType is the element type a float collective sends for Call.Wire w.
func WireDType(w half.Format) DType { return DType(w) }

// Bytes is the size of one element (0 for an unknown type).
func (d DType) Bytes() int {
	switch d {
	case DTypeFP32:
		return 4
	case DTypeFP16, DTypeBF16:
		return 2
	case DTypeInt64:
		return 8
	case DTypeUint8:
		return 1
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case DTypeFP32, DTypeFP16, DTypeBF16:
		return half.Format(d).String()
	case DTypeInt64:
		return "int64"
	case DTypeUint8:
		return "uint8"
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// float reports whether d is one of the float wire types, whose calls hold []float32.
func (d DType) float() bool { return d == DTypeFP32 || d == DTypeFP16 || d == DTypeBF16 }

// elems is the caller's buffer of one call, as the Ring's schedule sees it: a run of
// elements of wire type dt, counted in elements. Float collectives hold f (float32 in
// memory, sent as fp32, fp16 or bf16); AllReduceInt64 holds i and BroadcastBytes b, whose
// memory already is their wire encoding. Exactly one slice is set. A value type, so a call
// allocates nothing for it.
type elems struct {
	f  []float32
	i  []int64
	b  []byte
	dt DType
}

func floatElems(f []float32, w half.Format) elems { return elems{f: f, dt: WireDType(w)} }

func (e elems) len() int {
	switch e.dt {
	case DTypeInt64:
		return len(e.i)
	case DTypeUint8:
		return len(e.b)
	}
	return len(e.f)
}

// wire is the float format of a float call (FP32 for the exact types, which never round).
func (e elems) wire() half.Format {
	if e.dt.float() {
		return half.Format(e.dt)
	}
	return half.FP32
}

// slice is elements [lo, hi).
func (e elems) slice(lo, hi int) elems {
	switch e.dt {
	case DTypeInt64:
		e.i = e.i[lo:hi]
	case DTypeUint8:
		e.b = e.b[lo:hi]
	default:
		e.f = e.f[lo:hi]
	}
	return e
}

// direct reports whether the elements' memory is their wire encoding (fp32 and the exact
// types), so that a frame can be sent from it and received into it as it is.
func (e elems) direct() bool { return e.dt == DTypeFP32 || !e.dt.float() }

// mem views the elements' memory as bytes; only for direct types.
func (e elems) mem() []byte {
	switch e.dt {
	case DTypeInt64:
		return i64Bytes(e.i)
	case DTypeUint8:
		return e.b
	}
	return f32Bytes(e.f)
}

// payload returns the wire bytes of the elements: their memory for direct types, or the
// float values encoded into scratch (which must hold len words) for a 16-bit wire.
func (e elems) payload(scratch []uint16) []byte {
	if e.direct() {
		return e.mem()
	}
	return encode(e.f, e.wire(), scratch)
}

// round rounds float elements to the wire format (nothing for the exact types).
func (e elems) round() {
	if e.dt.float() {
		vec.Round(e.f, e.wire())
	}
}

// combine applies a received payload p (len(p) = e.len()·dt.Bytes()) to the elements: with
// reduce it reduces with op, otherwise it copies.
func (e elems) combine(p []byte, reduce bool, op Op) {
	switch e.dt {
	case DTypeInt64:
		combineInt64(e.i, p, reduce, op)
	case DTypeUint8:
		if len(e.b) > 0 && &e.b[0] != &p[0] { // else received in place (DirectReceiver)
			copy(e.b, p)
		}
	default:
		combine(e.f, p, e.wire(), reduce, op)
	}
}

// i64Bytes views x as its bytes (little-endian on the hosts the Ring runs on).
func i64Bytes(x []int64) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 8*len(x))
}

// bytesI64 views b (len a multiple of 8) as int64s, or reports false when b is misaligned.
func bytesI64(b []byte) ([]int64, bool) {
	if len(b) == 0 {
		return nil, true
	}
	if uintptr(unsafe.Pointer(&b[0]))%8 != 0 {
		return nil, false
	}
	return unsafe.Slice((*int64)(unsafe.Pointer(&b[0])), len(b)/8), true
}

// combineInt64 is combine for int64 elements: exact sums (wrapping modulo 2^64), maxima and
// minima, or a copy.
func combineInt64(dst []int64, p []byte, reduce bool, op Op) {
	src, ok := bytesI64(p)
	if !ok {
		for i := range dst {
			dst[i] = reduceInt64(dst[i], int64(binary.LittleEndian.Uint64(p[8*i:])), reduce, op)
		}
		return
	}
	src = src[:len(dst)]
	if !reduce {
		if len(dst) > 0 && &dst[0] != &src[0] { // else received in place (DirectReceiver)
			copy(dst, src)
		}
		return
	}
	for i, v := range src {
		dst[i] = reduceInt64(dst[i], v, true, op)
	}
}

func reduceInt64(acc, v int64, reduce bool, op Op) int64 {
	switch {
	case !reduce:
		return v
	case op == Max:
		return max(acc, v)
	case op == Min:
		return min(acc, v)
	}
	return acc + v
}
