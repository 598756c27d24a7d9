package grpcnet

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"testing"
	"time"
)

// tcpPair returns the two ends of a loopback TCP connection, the accepted one wrapped.
func tcpPair(t *testing.T) (wrapped *readAheadConn, peer net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	dialed := make(chan net.Conn, 1)
	go func() {
		c, err := net.Dial("tcp", l.Addr().String())
		if err != nil {
			t.Error(err)
		}
		dialed <- c
	}()
	c, err := Listener(l).Accept()
	if err != nil {
		t.Fatal(err)
	}
	p := <-dialed
	if p == nil {
		t.FailNow()
	}
	t.Cleanup(func() { c.Close(); p.Close() })
	rc, ok := c.(*readAheadConn)
	if !ok {
		t.Fatalf("Listener accepted a %T, want *readAheadConn", c)
	}
	return rc, p
}

// The wrapped connection is the same byte stream as the socket: any mix of read sizes (the
// framer's 9-byte headers and 16 KiB payloads among them) against any mix of write sizes and
// pauses returns every byte in order, then io.EOF.
func TestReadAheadStream(t *testing.T) {
	c, p := tcpPair(t)
	want := make([]byte, 3<<20)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range want {
		want[i] = byte(rng.Uint32())
	}
	go func() {
		rng := rand.New(rand.NewPCG(3, 4))
		for off := 0; off < len(want); {
			n := min(len(want)-off, 1+rng.IntN(40000))
			if _, err := p.Write(want[off : off+n]); err != nil {
				t.Error(err)
				return
			}
			off += n
			if rng.IntN(8) == 0 {
				time.Sleep(100 * time.Microsecond)
			}
		}
		p.Close()
	}()
	got := make([]byte, 0, len(want))
	sizes := []int{frameHeaderLen, 16384, 1, 4, 8, frameHeaderLen, 5, 70000}
	buf := make([]byte, 70000)
	ahead := 0
	for i := 0; ; i++ {
		n, err := c.Read(buf[:sizes[i%len(sizes)]])
		got = append(got, buf[:n]...)
		if c.hi > c.lo {
			ahead++
		}
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("read %d: %v", i, err)
		}
		if n == 0 {
			t.Fatalf("read %d: 0 bytes and no error", i)
		}
	}
	if !bytes.Equal(got, want) {
		t.Fatalf("stream differs: got %d bytes, want %d", len(got), len(want))
	}
	if ahead == 0 {
		t.Fatal("no read took bytes ahead: the side buffer was never used")
	}
	if n, err := c.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("read after EOF = %d, %v; want 0, io.EOF", n, err)
	}
}

// A payload read takes the next frame's header with it when it has arrived, so the header
// read that follows needs no syscall: one readv per frame.
func TestReadAheadTakesNextHeader(t *testing.T) {
	c, p := tcpPair(t)
	frame := func(n int, fill byte) []byte {
		b := bytes.Repeat([]byte{fill}, frameHeaderLen+n)
		b[0], b[1], b[2] = byte(n>>16), byte(n>>8), byte(n)
		return b
	}
	stream := append(frame(16384, 'a'), frame(100, 'b')...)
	if _, err := p.Write(stream); err != nil {
		t.Fatal(err)
	}
	hdr := make([]byte, frameHeaderLen)
	if _, err := io.ReadFull(c, hdr); err != nil {
		t.Fatal(err)
	}
	// Wait until the whole stream is in the socket, so the readv can take ahead.
	time.Sleep(20 * time.Millisecond)
	payload := make([]byte, 16384)
	if _, err := io.ReadFull(c, payload); err != nil {
		t.Fatal(err)
	}
	if c.hi-c.lo != frameHeaderLen {
		t.Fatalf("after the payload read %d bytes are ahead, want the next header's %d", c.hi-c.lo, frameHeaderLen)
	}
	// The next header comes from the side buffer even with the socket closed under it.
	if err := c.Conn.(*net.TCPConn).CloseRead(); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, hdr); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(hdr, stream[frameHeaderLen+16384:][:frameHeaderLen]) {
		t.Fatalf("header %x, want %x", hdr, stream[frameHeaderLen+16384:][:frameHeaderLen])
	}
}

// Deadlines work as on the plain connection: a read past its deadline fails with a timeout,
// and the stream goes on once the deadline is lifted.
func TestReadAheadDeadline(t *testing.T) {
	c, p := tcpPair(t)
	if err := c.SetReadDeadline(time.Now().Add(10 * time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 16)
	_, err := c.Read(buf)
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the deadline: %v, want a timeout", err)
	}
	if err := c.SetReadDeadline(time.Time{}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	n, err := c.Read(buf)
	if err != nil || string(buf[:n]) != "hello" {
		t.Fatalf("read after the deadline was lifted = %q, %v", buf[:n], err)
	}
	c.Close()
	if _, err := c.Read(buf); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("read on a closed connection: %v, want net.ErrClosed", err)
	}
}

// Connections that are not TCP (in-memory ones in tests) are left as they are.
func TestWrapConnLeavesOthers(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if c := wrapConn(a); c != a {
		t.Fatalf("wrapConn(net.Pipe) = %T, want the pipe itself", c)
	}
}
