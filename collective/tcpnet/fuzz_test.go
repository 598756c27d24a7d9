package tcpnet

import (
	"bytes"
	"errors"
	"io"
	"os"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

// chunkReader hands out its data a few bytes at a time, as a socket may, and every
// failEvery-th read fails with a deadline error, as a read cut short by a ctx does, so the
// fuzzer explores frames split across reads and interrupted reads resumed.
type chunkReader struct {
	data      []byte
	chunk     int
	failEvery int
	reads     int
}

func (r *chunkReader) Read(p []byte) (int, error) {
	r.reads++
	if r.failEvery > 0 && r.reads%r.failEvery == 0 {
		return 0, os.ErrDeadlineExceeded
	}
	if len(r.data) == 0 {
		return 0, io.EOF
	}
	n := min(len(p), r.chunk, len(r.data))
	copy(p, r.data[:n])
	r.data = r.data[n:]
	return n, nil
}

func fuzzSeeds(f *testing.F) {
	data := rawFrame(dataHeader(0, 8), []byte("12345678"))
	abort := rawFrame(collective.Header{Kind: collective.KindAbort, Src: 3, Length: 5}, []byte("oops!"))
	empty := rawFrame(collective.Header{Kind: collective.KindData, Op: collective.OpBarrier}, nil)
	huge := rawFrame(collective.Header{Kind: collective.KindAbort, Length: collective.MaxPayload}, nil)
	f.Add(data, uint16(64), uint8(1), uint8(0))
	f.Add(append(append(data, abort...), empty...), uint16(8), uint8(3), uint8(3))
	f.Add(data[:30], uint16(64), uint8(7), uint8(2))
	f.Add(data[:44], uint16(64), uint8(40), uint8(0))
	f.Add(huge, uint16(64), uint8(40), uint8(5))
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"), uint16(64), uint8(2), uint8(0))
	f.Add([]byte{}, uint16(0), uint8(1), uint8(2))
}

// FuzzReadFrame feeds arbitrary bytes, as a peer might send them, to the frame reader that
// Recv uses, interrupting some reads and resuming them into a fresh buffer as a Recv after a
// ctx timeout would: every outcome is a well-formed frame or an error, never a panic or a
// hang, and the frames are exactly what the bytes encode, in order.
func FuzzReadFrame(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, data []byte, bufLen uint16, chunk uint8, failEvery uint8) {
		r := &chunkReader{data: data, chunk: int(chunk)%64 + 1, failEvery: int(failEvery % 8)}
		if r.failEvery == 1 {
			r.failEvery = 2 // every read failing would never progress
		}
		var fr frameReader
		off := 0
		for reads := 0; ; reads++ {
			if reads > 4*len(data)+100 {
				t.Fatal("reader made no progress")
			}
			buf := make([]byte, bufLen)
			for i := range buf {
				buf[i] = 0xa5 // so a resumed frame cannot pass on a zeroed buffer's luck
			}
			h, p, err := fr.read(r, buf, nil)
			if err != nil {
				if errors.Is(err, os.ErrDeadlineExceeded) {
					continue // interrupted: resume
				}
				return
			}
			n := collective.HeaderSize + int(h.Length)
			if len(p) != int(h.Length) || len(p) > len(buf) || off+n > len(data) {
				t.Fatalf("frame of length %d at offset %d: payload %d, buf %d, data %d", h.Length, off, len(p), len(buf), len(data))
			}
			var enc [collective.HeaderSize]byte
			collective.PutHeader(enc[:], h)
			if !bytes.Equal(enc[:], data[off:off+collective.HeaderSize]) ||
				!bytes.Equal(p, data[off+collective.HeaderSize:off+n]) {
				t.Fatalf("frame %+v at offset %d does not match the bytes it was read from", h, off)
			}
			off += n
		}
	})
}

// FuzzHello feeds arbitrary bytes to the acceptor's side of the handshake: the hello reader
// and its verification never panic, and bound what they read.
func FuzzHello(f *testing.F) {
	secret := []byte("fuzz secret")
	hello := collective.NewHello(secret, "job", 1, 4, time.Now())
	valid := rawFrame(collective.Header{Kind: collective.KindHello, Src: 1, Length: uint32(len(hello))}, hello)
	f.Add(valid)
	f.Add(valid[:50])
	f.Add(rawFrame(collective.Header{Kind: collective.KindHello, Length: 1 << 20}, nil))
	f.Add(rawFrame(dataHeader(0, 4), []byte("abcd")))
	f.Fuzz(func(t *testing.T, data []byte) {
		h, p, err := readHello(bytes.NewReader(data))
		if err != nil {
			return
		}
		if h.Kind != collective.KindHello || len(p) > maxHelloBytes {
			t.Fatalf("accepted hello %+v with %d bytes", h, len(p))
		}
		// Every byte of a hello is under its MAC, so only a seed's hello, unchanged, can
		// verify (the fuzzer cannot forge one); it says rank 1, as the seeds do.
		rank, err := collective.VerifyHello(secret, "job", 4, p, time.Now())
		if err == nil && (rank != 1 || len(p) != len(hello)) {
			t.Fatalf("a %d-byte hello verified as rank %d", len(p), rank)
		}
	})
}
