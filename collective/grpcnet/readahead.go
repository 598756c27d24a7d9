package grpcnet

import (
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Read-ahead of one HTTP/2 frame header.
//
// With gRPC's read buffer off (see ioBufferSize), its framer reads every frame with two reads
// on the connection: the 9-byte frame header, then the payload straight into a message buffer.
// Data frames are at most 16 KiB (gRPC-go does not negotiate larger ones), so a 64 MiB
// collective costs 8,192 header reads per rank: a profile of a 2-rank all-reduce put 12% of
// the receiver's CPU in them. A readAheadConn answers each payload read with one readv that
// also takes the next frame's header, if it has arrived, into a 9-byte side buffer, and serves
// the following header read from there: one syscall per frame, and no payload byte is copied
// in user space (the alternative, a buffered reader, copies every byte once more and measured
// slower than the two reads).
//
// It is a plain byte stream to its reader: read-ahead only takes bytes the kernel already
// holds (readv returns what is there), never waits for them, and hands them out in order.

// frameHeaderLen is the size of an HTTP/2 frame header (RFC 9113 §4.1).
const frameHeaderLen = 9

// readAheadConn is a TCP connection whose Read takes up to frameHeaderLen bytes beyond the
// caller's buffer. Reads must not be concurrent (gRPC reads each connection from one
// goroutine); writes and every other method are the connection's own.
type readAheadConn struct {
	// net.Conn, not *net.TCPConn: ReadFrom and WriteTo must not be promoted, since
	// io.Copy would then read the socket around the side buffer.
	net.Conn
	rc     syscall.RawConn
	ahead  [frameHeaderLen]byte
	lo, hi int // unread bytes of ahead
	iov    [2]unix.Iovec
	// result of the readv inside rc.Read's callback (kept here so the closure allocates
	// nothing per call)
	n     int
	errno error
	read  func(fd uintptr) bool
}

// wrapConn returns c with header read-ahead if it is a TCP connection, else c unchanged.
func wrapConn(c net.Conn) net.Conn {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return c
	}
	rc, err := tc.SyscallConn()
	if err != nil {
		return c
	}
	r := &readAheadConn{Conn: tc, rc: rc}
	r.read = r.readv
	return r
}

// readv is rc.Read's callback: one readv into the caller's buffer and the side buffer. It
// returns false (wait for the socket to become readable, honouring the read deadline) only
// on EAGAIN.
func (c *readAheadConn) readv(fd uintptr) bool {
	for {
		n, _, e := unix.Syscall(unix.SYS_READV, fd, uintptr(unsafe.Pointer(&c.iov[0])), 2)
		switch e {
		case 0:
			c.n, c.errno = int(n), nil
			return true
		case unix.EINTR:
			continue
		case unix.EAGAIN:
			return false
		default:
			c.n, c.errno = 0, e
			return true
		}
	}
}

// Read fills p from the side buffer if it holds bytes, else from the socket with read-ahead.
func (c *readAheadConn) Read(p []byte) (int, error) {
	if c.lo < c.hi {
		n := copy(p, c.ahead[c.lo:c.hi])
		c.lo += n
		return n, nil
	}
	if len(p) == 0 {
		return 0, nil
	}
	c.iov[0].Base, c.iov[1].Base = &p[0], &c.ahead[0]
	c.iov[0].SetLen(len(p))
	c.iov[1].SetLen(frameHeaderLen)
	err := c.rc.Read(c.read)
	// Drop the reference to p: it is the caller's again.
	c.iov[0].Base = nil
	n, errno := c.n, c.errno
	c.n, c.errno = 0, nil
	if err == nil && errno != nil {
		err = os.NewSyscallError("readv", errno)
	}
	if err != nil {
		// As net.TCPConn.Read reports them (deadline and close errors unwrapped inside).
		return 0, &net.OpError{Op: "read", Net: "tcp", Source: c.LocalAddr(), Addr: c.RemoteAddr(), Err: err}
	}
	if n == 0 {
		return 0, io.EOF
	}
	if n > len(p) {
		c.lo, c.hi = 0, n-len(p)
		n = len(p)
	}
	return n, nil
}

// readAheadListener wraps the connections a listener accepts with wrapConn.
type readAheadListener struct{ net.Listener }

func (l readAheadListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return wrapConn(c), nil
}

// Listener returns l with HTTP/2 frame-header read-ahead on every TCP connection it accepts
// (readAheadConn). Serve the process's gRPC server, the one built with ServerOptions, on it:
// frame streams are received on the server side.
func Listener(l net.Listener) net.Listener { return readAheadListener{l} }
