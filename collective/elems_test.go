package collective

import (
	"encoding/binary"
	"math"
	"testing"
)

// TestCombineInt64Misaligned: a transport may hand back a payload at any offset of its
// buffer; int64 reductions must then take the byte-wise path and stay exact.
func TestCombineInt64Misaligned(t *testing.T) {
	src := []int64{1<<53 + 1, -(1 << 60), math.MaxInt64, 7}
	raw := alignedBytes(8*len(src) + 1)
	p := raw[1:] // misaligned for int64
	for i, v := range src {
		binary.LittleEndian.PutUint64(p[8*i:], uint64(v))
	}
	for _, tc := range []struct {
		op     Op
		reduce bool
		want   []int64
	}{
		{Sum, true, []int64{1<<53 + 2, -(1 << 60) - 1, math.MinInt64, 9}}, // wraps as Go's int64 does
		{Max, true, []int64{1<<53 + 1, -1, math.MaxInt64, 7}},
		{Min, true, []int64{1, -(1 << 60), 1, 2}},
		{Sum, false, src},
	} {
		dst := []int64{1, -1, 1, 2}
		combineInt64(dst, p, tc.reduce, tc.op)
		for i := range dst {
			if dst[i] != tc.want[i] {
				t.Errorf("%v reduce=%v: element %d = %d, want %d", tc.op, tc.reduce, i, dst[i], tc.want[i])
			}
		}
	}
}

func TestParseHeaderTypedFrames(t *testing.T) {
	b := make([]byte, HeaderSize)
	for _, tc := range []struct {
		dt     DType
		count  uint32
		length uint32
		ok     bool
	}{
		{DTypeInt64, 3, 24, true},
		{DTypeInt64, 3, 12, false},
		{DTypeUint8, 5, 5, true},
		{DTypeUint8, 5, 10, false},
		{DType(3), 1, 4, false}, // no such type
	} {
		PutHeader(b, Header{Kind: KindData, DType: tc.dt, Op: OpAllReduce, Count: tc.count, Length: tc.length})
		_, err := ParseHeader(b)
		if (err == nil) != tc.ok {
			t.Errorf("%v × %d in %d bytes: %v", tc.dt, tc.count, tc.length, err)
		}
	}
}
