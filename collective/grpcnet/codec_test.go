package grpcnet

import (
	"bytes"
	"errors"
	"testing"

	"google.golang.org/grpc/mem"

	"github.com/qvd/qvd/collective"
)

// split cuts b into buffers at the given lengths (mod the remainder), as gRPC hands a
// message over in pieces of its HTTP/2 frames.
func split(b []byte, cuts []byte) mem.BufferSlice {
	var out mem.BufferSlice
	for i := 0; len(b) > 0; i++ {
		n := len(b)
		if len(cuts) > 0 {
			n = min(n, int(cuts[i%len(cuts)])+1)
		}
		out = append(out, mem.SliceBuffer(b[:n]))
		b = b[n:]
	}
	return out
}

func TestFrameLoadSplitAnywhere(t *testing.T) {
	payload := make([]byte, 1000)
	pattern(payload, 9)
	msg := newRawFrame(dataHeader(3, len(payload), 5, 6), payload).b
	for _, cuts := range [][]byte{nil, {0}, {3}, {38, 1}, {39}, {40}, {41}, {200, 7}} {
		f := new(inFrame)
		f.load(split(msg, cuts))
		if f.err != nil {
			t.Fatalf("cuts %v: %v", cuts, f.err)
		}
		if f.hdr != dataHeader(3, len(payload), 5, 6) {
			t.Fatalf("cuts %v: header %+v", cuts, f.hdr)
		}
		got := make([]byte, len(payload))
		if n := f.copyPayload(got); n != len(payload) || !bytes.Equal(got, payload) {
			t.Fatalf("cuts %v: payload of %d bytes differs", cuts, n)
		}
		f.release()
	}
}

func TestCodecRefusesForeignTypes(t *testing.T) {
	var c frameCodec
	if _, err := c.Marshal("text"); err == nil {
		t.Fatal("marshalled a string")
	}
	if err := c.Unmarshal(nil, new(int)); err == nil {
		t.Fatal("unmarshalled into an int")
	}
}

// FuzzFrameLoad: whatever bytes a peer sends, however gRPC splits them, parsing a frame never
// panics, refuses with ErrProtocol, or yields a header whose length matches the payload.
func FuzzFrameLoad(f *testing.F) {
	f.Add(newRawFrame(dataHeader(0, 8, 1, 0), make([]byte, 8)).b, []byte{5})
	f.Add(newRawFrame(collective.Header{Kind: collective.KindAbort, Length: 3}, []byte("bad")).b, []byte{})
	f.Add([]byte("VQ"), []byte{1})
	f.Fuzz(func(t *testing.T, msg, cuts []byte) {
		fr := new(inFrame)
		fr.load(split(msg, cuts))
		if fr.err != nil {
			if !errors.Is(fr.err, collective.ErrProtocol) {
				t.Fatalf("error %v does not wrap ErrProtocol", fr.err)
			}
			return
		}
		buf := make([]byte, fr.hdr.Length)
		if n := fr.copyPayload(buf); n != int(fr.hdr.Length) || n != len(msg)-collective.HeaderSize {
			t.Fatalf("copied %d bytes of a %d-byte payload in a %d-byte message", n, fr.hdr.Length, len(msg))
		}
		fr.release()
	})
}

func TestDirtyPoolTiers(t *testing.T) {
	p := new(dirtyPool)
	for _, c := range []struct{ n, cap int }{{1, 4 << 10}, {4 << 10, 4 << 10}, {4<<10 + 1, 8 << 10}, {16 << 10, 16 << 10}, {1 << 20, 1 << 20}, {1<<20 + 1, 1<<20 + 1}} {
		b := p.Get(c.n)
		if len(*b) != c.n || cap(*b) != c.cap {
			t.Fatalf("Get(%d): len %d cap %d, want cap %d", c.n, len(*b), cap(*b), c.cap)
		}
		p.Put(b)
	}
	odd := make([]byte, 5000)
	p.Put(&odd) // not one of its sizes: ignored
}
