package collective

import (
	"encoding/binary"
	"math"
	"unsafe"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// The frame format is little-endian. On a little-endian host a []float32 (or a []uint16 of
// 16-bit words) already is its wire encoding, so the ring sends fp32 pieces straight out of
// the caller's buffer and adds received fp32 payloads straight out of the receive buffer,
// without an encode or decode pass. hostLittleEndian guards that assumption: NewRing refuses
// to run on a big-endian host rather than put wrong bytes on the wire.
var hostLittleEndian = func() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}()

// f32Bytes views x as its bytes (zero-copy; little-endian on the hosts we run on).
func f32Bytes(x []float32) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x))
}

// u16Bytes views x as its bytes.
func u16Bytes(x []uint16) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 2*len(x))
}

// bytesF32 views b (len a multiple of 4) as float32s, or reports false when b is not 4-byte
// aligned (a transport may hand back a payload at any offset of its buffer) so the caller
// takes the byte-wise path instead of making a misaligned pointer.
func bytesF32(b []byte) ([]float32, bool) {
	if len(b) == 0 {
		return nil, true
	}
	if uintptr(unsafe.Pointer(&b[0]))%4 != 0 {
		return nil, false
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), len(b)/4), true
}

// bytesU16 views b (len even) as 16-bit words, or reports false when b is misaligned.
func bytesU16(b []byte) ([]uint16, bool) {
	if len(b) == 0 {
		return nil, true
	}
	if uintptr(unsafe.Pointer(&b[0]))%2 != 0 {
		return nil, false
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), len(b)/2), true
}

// alignedBytes allocates n bytes whose start is 8-byte aligned (it is backed by uint64s), so
// payloads received into it can be viewed as float32 or uint16 elements.
func alignedBytes(n int) []byte {
	w := make([]uint64, (n+7)/8)
	if len(w) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), n)
}

// combine applies a received payload p of wire elements (len(p) = len(dst)*wire.Bytes()) to
// dst: with reduce it adds (Sum, Avg) or takes the maximum (Max) or minimum (Min) in fp32, otherwise it
// copies (all-gather, broadcast). Accumulation is always fp32; a 16-bit word is widened
// exactly before it meets the running value (Micikevicius et al. 2018).
func combine(dst []float32, p []byte, wire half.Format, reduce bool, op Op) {
	switch wire {
	case half.FP32:
		src, ok := bytesF32(p)
		if !ok {
			combineF32Slow(dst, p, reduce, op)
			return
		}
		src = src[:len(dst)]
		switch {
		case !reduce:
			if len(dst) > 0 && &dst[0] == &src[0] {
				return // received in place (DirectReceiver)
			}
			copy(dst, src)
		case op == Max:
			// Builtin max semantics (commutative: NaN wins, +0 > -0), so the result does not
			// depend on the order in which the ring visits the ranks.
			vec.Max(dst, src)
		case op == Min:
			for i, v := range src {
				dst[i] = min(dst[i], v)
			}
		default:
			vec.Add(dst, src)
		}
	case half.FP16, half.BF16:
		src, ok := bytesU16(p)
		if !ok {
			combine16Slow(dst, p, wire, reduce, op)
			return
		}
		src = src[:len(dst)]
		switch {
		case !reduce && wire == half.FP16:
			vec.DecodeF16(dst, src)
		case !reduce:
			half.DecodeBF16(dst, src)
		case op == Max && wire == half.FP16:
			for i, w := range src {
				dst[i] = max(dst[i], half.F16ToF32(w))
			}
		case op == Max:
			for i, w := range src {
				dst[i] = max(dst[i], half.BF16ToF32(w))
			}
		case op == Min && wire == half.FP16:
			for i, w := range src {
				dst[i] = min(dst[i], half.F16ToF32(w))
			}
		case op == Min:
			for i, w := range src {
				dst[i] = min(dst[i], half.BF16ToF32(w))
			}
		case wire == half.FP16:
			vec.AddDecodedF16(dst, src)
		default:
			vec.AddDecodedBF16(dst, src)
		}
	}
}

// combineF32Slow is combine for a misaligned fp32 payload.
func combineF32Slow(dst []float32, p []byte, reduce bool, op Op) {
	for i := range dst {
		v := math.Float32frombits(binary.LittleEndian.Uint32(p[4*i:]))
		switch {
		case !reduce:
			dst[i] = v
		case op == Max:
			dst[i] = max(dst[i], v)
		case op == Min:
			dst[i] = min(dst[i], v)
		default:
			dst[i] += v
		}
	}
}

// combine16Slow is combine for a misaligned 16-bit payload.
func combine16Slow(dst []float32, p []byte, wire half.Format, reduce bool, op Op) {
	for i := range dst {
		w := binary.LittleEndian.Uint16(p[2*i:])
		var v float32
		if wire == half.FP16 {
			v = half.F16ToF32(w)
		} else {
			v = half.BF16ToF32(w)
		}
		switch {
		case !reduce:
			dst[i] = v
		case op == Max:
			dst[i] = max(dst[i], v)
		case op == Min:
			dst[i] = min(dst[i], v)
		default:
			dst[i] += v
		}
	}
}

// encode returns the wire bytes of src: for fp32 a view of src itself (the transport copies
// or writes it before Send returns, per the Transport contract), for fp16/bf16 the words
// encoded into scratch, which must hold len(src) words.
func encode(src []float32, wire half.Format, scratch []uint16) []byte {
	switch wire {
	case half.FP16:
		w := scratch[:len(src)]
		vec.EncodeF16(w, src)
		return u16Bytes(w)
	case half.BF16:
		w := scratch[:len(src)]
		vec.EncodeBF16(w, src)
		return u16Bytes(w)
	}
	return f32Bytes(src)
}
