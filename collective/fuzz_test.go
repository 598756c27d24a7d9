package collective_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"math"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
	"github.com/qvd/qvd/internal/half"
)

// FuzzParseHeader: ParseHeader never panics, and every header it accepts encodes back to the
// same bytes and parses to the same Header.
func FuzzParseHeader(f *testing.F) {
	b := make([]byte, collective.HeaderSize)
	collective.PutHeader(b, goodHeader)
	f.Add(bytes.Clone(b))
	collective.PutHeader(b, collective.Header{Kind: collective.KindAbort, Tag: 3, Step: 1, Length: 40})
	f.Add(bytes.Clone(b))
	collective.PutHeader(b, collective.Header{Kind: collective.KindHello, Length: 60})
	f.Add(bytes.Clone(b))
	collective.PutHeader(b, collective.Header{Kind: collective.KindData, DType: collective.DTypeBF16, Op: collective.OpBarrier, Count: 1 << 25, Length: 1 << 26})
	f.Add(bytes.Clone(b))
	f.Add([]byte{0x56, 0x51, 1})
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := collective.ParseHeader(b)
		if err != nil {
			if !errors.Is(err, collective.ErrProtocol) {
				t.Fatalf("ParseHeader error %v does not wrap ErrProtocol", err)
			}
			return
		}
		out := make([]byte, collective.HeaderSize)
		collective.PutHeader(out, h)
		if !bytes.Equal(out, b[:collective.HeaderSize]) {
			t.Fatalf("header %+v re-encodes as %x, parsed from %x", h, out, b[:collective.HeaderSize])
		}
		h2, err := collective.ParseHeader(out)
		if err != nil || h2 != h {
			t.Fatalf("round trip: %+v, %v; want %+v", h2, err, h)
		}
	})
}

// rawHeader reads a header's fields at their offsets without any check, so the fuzzer can
// make the ring meet every field value, valid or not.
func rawHeader(b []byte) collective.Header {
	return collective.Header{
		Kind: b[3], DType: collective.DType(b[4]), Op: b[5],
		Src:    binary.LittleEndian.Uint16(b[6:]),
		Tag:    binary.LittleEndian.Uint64(b[8:]),
		Step:   binary.LittleEndian.Uint32(b[16:]),
		Piece:  binary.LittleEndian.Uint32(b[20:]),
		Offset: binary.LittleEndian.Uint64(b[24:]),
		Count:  binary.LittleEndian.Uint32(b[32:]),
		Length: binary.LittleEndian.Uint32(b[36:]),
	}
}

// fuzzInput encodes a test case: wire, op and length, then frames (header, payload).
func fuzzInput(wire half.Format, op collective.Op, length int, frames ...[]byte) []byte {
	b := []byte{byte(wire), byte(op - 1), byte(length)}
	for _, f := range frames {
		b = append(b, f...)
	}
	return b
}

func fuzzFrame(h collective.Header, payload []byte) []byte {
	h.Length = uint32(len(payload))
	b := make([]byte, collective.HeaderSize)
	collective.PutHeader(b, h)
	return append(b, payload...)
}

// FuzzRingFrames feeds arbitrary frames from a fake predecessor into rank 1 of a group of two
// running an all-reduce, and requires an error or the correct result, never a panic or a
// hang. The correct result is what the frames the ring accepted imply: its own shard [s1, n)
// reduced with the first frame's values, and shard [0, s1) copied from the second.
func FuzzRingFrames(f *testing.F) {
	collectivetest.CheckGoroutines(f)
	for _, wire := range []half.Format{half.FP32, half.FP16, half.BF16} {
		for _, op := range []collective.Op{collective.Sum, collective.Avg, collective.Max} {
			for _, length := range []int{0, 1, 5, 16} {
				s1 := (length + 1) / 2
				h := collective.Header{Kind: collective.KindData, DType: collective.WireDType(wire), Op: collective.OpAllReduce,
					Tag: collective.MaxUserTag, Offset: uint64(s1), Count: uint32(length - s1)}
				p1 := bytes.Repeat([]byte{0x40, 0x3f}, (length-s1)*wire.Bytes()/2)
				h2 := h
				h2.Step, h2.Offset, h2.Count = 1, 0, uint32(s1)
				p2 := bytes.Repeat([]byte{0x00, 0xc1}, s1*wire.Bytes()/2)
				f.Add(fuzzInput(wire, op, length, fuzzFrame(h, p1), fuzzFrame(h2, p2)))
				f.Add(fuzzInput(wire, op, length, fuzzFrame(h, p1)))
			}
		}
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		if len(in) < 3 {
			return
		}
		wire := half.Format(in[0] % 3)
		op := collective.Op(in[1]%3 + 1)
		length := int(in[2] % 17)
		rest := in[3:]

		net, ts := collective.NewInproc(2, 7)
		_ = net
		ring, err := collective.NewRing(ts[1], collective.Config{Transport: "inproc", Timeout: 100 * time.Millisecond, ChunkBytes: 4096})
		if err != nil {
			t.Fatal(err)
		}
		defer func() { ring.Close(); ts[0].Close(); ts[1].Close() }()

		buf := make([]float32, length)
		for i := range buf {
			buf[i] = float32(i)*1.25 - 3
		}
		start := append([]float32(nil), buf...)
		errc := make(chan error, 1)
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		go func() { errc <- ring.AllReduce(ctx, buf, op, collective.Call{Wire: wire}) }()

		var mine [][]byte // payloads of data frames for the call's tag, in order
		for n := 0; len(rest) >= collective.HeaderSize && n < 40; n++ {
			h := rawHeader(rest)
			rest = rest[collective.HeaderSize:]
			p := rest[:min(int(h.Length), len(rest), 1<<16)]
			rest = rest[len(p):]
			h.Length = uint32(len(p))
			if h.Tag == collective.MaxUserTag && h.Kind == collective.KindData {
				mine = append(mine, p)
			}
			sctx, scancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
			err := ts[0].Send(sctx, 1, h, p)
			scancel()
			if err != nil {
				break
			}
		}
		// End the call if the frames left it waiting.
		sctx, scancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		_ = ts[0].Send(sctx, 1, collective.Header{Kind: collective.KindAbort, Tag: collective.MaxUserTag, Length: 3}, []byte("end"))
		scancel()

		select {
		case err = <-errc:
		case <-time.After(10 * time.Second):
			t.Fatal("hang: the all-reduce did not return")
		}
		if err != nil {
			return
		}
		if len(mine) < 2 {
			t.Fatalf("the call succeeded on %d data frames, needs 2", len(mine))
		}
		s1 := (length + 1) / 2
		want := append([]float32(nil), start...)
		decode := func(p []byte, i int) float32 {
			switch wire {
			case half.FP16:
				return half.F16ToF32(binary.LittleEndian.Uint16(p[2*i:]))
			case half.BF16:
				return half.BF16ToF32(binary.LittleEndian.Uint16(p[2*i:]))
			}
			return math.Float32frombits(binary.LittleEndian.Uint32(p[4*i:]))
		}
		for i := s1; i < length; i++ {
			v := decode(mine[0], i-s1)
			if op == collective.Max {
				want[i] = max(want[i], v)
			} else {
				want[i] += v
			}
			if op == collective.Avg {
				want[i] /= 2
			}
			want[i] = wire.Round(want[i])
		}
		for i := range s1 {
			want[i] = decode(mine[1], i)
		}
		for i := range want {
			if math.Float32bits(want[i]) != math.Float32bits(buf[i]) {
				t.Fatalf("element %d = %v (%#x), want %v (%#x)", i, buf[i], math.Float32bits(buf[i]), want[i], math.Float32bits(want[i]))
			}
		}
	})
}
