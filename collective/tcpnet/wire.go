package tcpnet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	"github.com/qvd/qvd/collective"
)

// maxHelloBytes bounds a hello frame's payload before it is read. collective's hello is 60
// bytes; the bound leaves room for a later version without letting an unauthenticated
// stranger make us read more than this.
const maxHelloBytes = 1 << 10

// aLongTimeAgo is a deadline in the past: setting it makes a blocked read or write on a
// connection return at once, which is how a context's end interrupts socket I/O.
var aLongTimeAgo = time.Unix(1, 0)

// frameReader reads frames from one connection. It keeps the progress of a frame whose read
// was interrupted (by the caller's ctx), so the next read carries on where it stopped and the
// stream stays in step: an interrupted Recv neither loses nor corrupts a frame.
type frameReader struct {
	hdr     [collective.HeaderSize]byte
	hdrN    int               // bytes of hdr read for the frame in progress
	h       collective.Header // the frame in progress, once its header is complete
	inFrame bool              // h is valid; its payload is being read
	part    []byte            // payload bytes read by an interrupted read, copied out of its buffer
}

// read reads the next frame from r: its payload lands in buf. A frame whose payload does not
// fit buf is an error and its payload is left unread. If r fails, the bytes already read are
// kept and a later read resumes the frame (the caller decides whether the failure allows
// that). It never panics, whatever r yields.
//
// dst, if not nil, may redirect a data frame's payload: once the header is known, a slice of
// exactly the payload's length that dst returns receives it instead of buf (see
// collective.DirectReceiver).
func (f *frameReader) read(r io.Reader, buf []byte, dst func(collective.Header) []byte) (collective.Header, []byte, error) {
	if !f.inFrame {
		n, err := io.ReadFull(r, f.hdr[f.hdrN:])
		f.hdrN += n
		if err != nil {
			if err == io.EOF && f.hdrN == 0 {
				// The peer closed between frames: an orderly end, but still an end.
				return collective.Header{}, nil, fmt.Errorf("connection closed: %w", err)
			}
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return collective.Header{}, nil, fmt.Errorf("reading frame header (%d of %d bytes): %w", f.hdrN, collective.HeaderSize, err)
		}
		h, err := collective.ParseHeader(f.hdr[:])
		if err != nil {
			return collective.Header{}, nil, err
		}
		f.h, f.inFrame, f.hdrN = h, true, 0
	}
	h := f.h
	if dst != nil && h.Kind == collective.KindData && h.Length > 0 {
		if d := dst(h); len(d) == int(h.Length) {
			buf = d
		}
	}
	if int(h.Length) > len(buf) {
		return h, nil, fmt.Errorf("%w: %w: frame carries %d payload bytes, the receive buffer holds %d",
			collective.ErrProtocol, io.ErrShortBuffer, h.Length, len(buf))
	}
	got := copy(buf, f.part)
	f.part = nil
	m, err := io.ReadFull(r, buf[got:h.Length])
	got += m
	if err != nil {
		// Keep what arrived: buf is the caller's again once we return.
		f.part = append([]byte(nil), buf[:got]...)
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return h, nil, fmt.Errorf("reading frame payload (%d of %d bytes): %w", got, h.Length, err)
	}
	f.inFrame = false
	return h, buf[:h.Length], nil
}

// writeHello sends the hello frame by which rank proves it belongs to job.
func writeHello(w io.Writer, secret []byte, job string, rank, size int) error {
	hello := collective.NewHello(secret, job, rank, size, time.Now())
	frame := make([]byte, collective.HeaderSize+len(hello))
	collective.PutHeader(frame, collective.Header{Kind: collective.KindHello, Src: uint16(rank), Length: uint32(len(hello))})
	copy(frame[collective.HeaderSize:], hello)
	if _, err := w.Write(frame); err != nil {
		return fmt.Errorf("sending hello: %w", err)
	}
	return nil
}

// readHello reads the hello frame that opens a connection and returns its header and payload,
// unverified: the caller checks it against the secret(s) it knows.
func readHello(r io.Reader) (collective.Header, []byte, error) {
	var hdr [collective.HeaderSize]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return collective.Header{}, nil, fmt.Errorf("reading hello: %w", err)
	}
	h, err := collective.ParseHeader(hdr[:])
	if err != nil {
		return h, nil, fmt.Errorf("hello: %w", err)
	}
	if h.Kind != collective.KindHello {
		return h, nil, fmt.Errorf("%w: connection opened with a frame of kind %d, want a hello", collective.ErrProtocol, h.Kind)
	}
	if h.Length > maxHelloBytes {
		return h, nil, fmt.Errorf("%w: hello of %d bytes exceeds %d", collective.ErrProtocol, h.Length, maxHelloBytes)
	}
	payload := make([]byte, h.Length)
	if _, err := io.ReadFull(r, payload); err != nil {
		return h, nil, fmt.Errorf("reading hello payload: %w", err)
	}
	return h, payload, nil
}

// ctxErr returns the context's error if the operation that failed with err failed because
// ctx ended: either ctx reports it, or err is the socket deadline we derived from ctx's
// deadline firing a moment before ctx's own timer.
func ctxErr(ctx context.Context, err error) error {
	if e := ctx.Err(); e != nil {
		return e
	}
	if errors.Is(err, os.ErrDeadlineExceeded) {
		if dl, ok := ctx.Deadline(); ok && !time.Now().Before(dl) {
			return context.DeadlineExceeded
		}
	}
	return nil
}

// tune sets the options a bulk data connection wants. TCP_NODELAY: frames are written whole
// with one writev, so Nagle would only delay the last segment of each frame (and small
// frames, such as a barrier's, entirely). Keepalive is set by the dialer and listener.
func tune(c net.Conn, cfg Config) error {
	tc, ok := c.(*net.TCPConn)
	if !ok {
		return nil
	}
	if err := tc.SetNoDelay(true); err != nil {
		return fmt.Errorf("setting TCP_NODELAY: %w", err)
	}
	if cfg.SocketBuffer > 0 {
		if err := tc.SetReadBuffer(cfg.SocketBuffer); err != nil {
			return fmt.Errorf("setting SO_RCVBUF: %w", err)
		}
		if err := tc.SetWriteBuffer(cfg.SocketBuffer); err != nil {
			return fmt.Errorf("setting SO_SNDBUF: %w", err)
		}
	}
	return nil
}

func keepAlive(cfg Config) net.KeepAliveConfig {
	return net.KeepAliveConfig{Enable: true, Idle: cfg.KeepAlive, Interval: cfg.KeepAlive / 3, Count: 3}
}

// ctxWatch makes one direction of a connection honour the context of the operation running on
// it: the context's deadline becomes the socket deadline, and the context's cancellation sets
// a deadline in the past, which unblocks the read or write at once.
//
// Registering a callback with context.AfterFunc allocates, so the watch re-arms only when the
// operation's context (its Done channel) differs from the previous one's. A collective call
// passes one context to all of its Sends and Recvs, so steady state costs a mutex and a
// comparison per frame and allocates nothing.
type ctxWatch struct {
	mu       sync.Mutex
	set      func(time.Time) error // the connection's SetReadDeadline or SetWriteDeadline
	done     <-chan struct{}       // Done of the context being watched
	stop     func() bool           // unregisters the callback for done
	gen      uint64                // bumped on every re-arm, so a late callback for an old context does nothing
	fired    bool                  // the watched context ended and the past deadline is set
	deadline time.Time             // the deadline last given to set
	closed   bool
}

// init points the watch at a connection (whose deadline is unset), forgetting any previous one.
func (w *ctxWatch) init(set func(time.Time) error) {
	w.mu.Lock()
	w.disarmLocked()
	w.set = set
	w.deadline = time.Time{}
	w.mu.Unlock()
}

// arm prepares the connection for an operation under ctx.
func (w *ctxWatch) arm(ctx context.Context) {
	done := ctx.Done()
	dl, _ := ctx.Deadline()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed || w.set == nil {
		return
	}
	if done != w.done {
		w.disarmLocked()
		w.done = done
		if done != nil {
			gen := w.gen
			w.stop = context.AfterFunc(ctx, func() {
				w.mu.Lock()
				if w.gen == gen && !w.closed {
					w.fired = true
					w.setLocked(aLongTimeAgo)
				}
				w.mu.Unlock()
			})
		}
	}
	if w.fired {
		return // keep the past deadline: this context has ended
	}
	if !dl.Equal(w.deadline) {
		w.setLocked(dl)
	}
}

// override disarms the watch and sets deadline t, for I/O that no caller's ctx governs.
func (w *ctxWatch) override(t time.Time) {
	w.mu.Lock()
	w.disarmLocked()
	if !w.closed && w.set != nil {
		w.setLocked(t)
	}
	w.mu.Unlock()
}

func (w *ctxWatch) setLocked(t time.Time) {
	w.deadline = t
	// An error here means the connection is closed; the I/O that follows reports it.
	_ = w.set(t)
}

func (w *ctxWatch) disarmLocked() {
	if w.stop != nil {
		w.stop()
		w.stop = nil
	}
	w.done = nil
	w.gen++
	w.fired = false
}

// close unregisters the callback, so a long-lived context no longer references the
// connection, and makes later arms no-ops.
func (w *ctxWatch) close() {
	w.mu.Lock()
	w.disarmLocked()
	w.closed = true
	w.mu.Unlock()
}
