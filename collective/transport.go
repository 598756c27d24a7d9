package collective

import "context"

// Transport moves frames between the ranks of one group: the seam that lets the ring
// algorithms run over goroutines in a test (NewInproc), gRPC streams or raw TCP.
//
// Frames from one rank to another arrive in the order they were sent, whole or not at all.
// Send may be called concurrently for different peers; concurrent Sends to the same peer do
// not interleave their bytes but their order is unspecified. Recv for a given peer must be
// called from one goroutine at a time.
type Transport interface {
	Rank() int
	Size() int
	// Addr returns a printable address of rank r for error messages ("" if unknown).
	Addr(r int) string
	// Send transmits one frame (h.Length must equal len(payload)). The payload may be
	// reused as soon as Send returns. A broken or closed connection, or ctx ending, is an
	// error (a *PeerError naming peer where the peer is at fault).
	Send(ctx context.Context, peer int, h Header, payload []byte) error
	// Recv returns the next frame from peer, its payload copied into buf (an error, not a
	// truncation, if buf is too small). It blocks until a frame arrives, the connection
	// breaks (ErrPeerGone), the transport closes (ErrClosed) or ctx ends.
	Recv(ctx context.Context, peer int, buf []byte) (Header, []byte, error)
	// Close releases the transport; blocked Sends and Recvs return ErrClosed. Safe twice.
	Close() error
}

// DirectReceiver is an optional Transport extension: RecvInto is Recv, except that once a data
// frame's header is read, dst(h) may name where its payload belongs — a slice of exactly
// h.Length bytes — and the payload is read straight into it instead of into buf. The Ring uses
// it to land all-gather and broadcast pieces in the caller's buffer without a copy. dst runs
// on the receiving goroutine and must not block. If ctx ends after dst named a destination,
// RecvInto must stop writing there before it returns, and must leave the stream in step:
// resume or skip the rest of the frame on the next call, not break the connection (the Ring
// cancels a read into the buffer of a call that has ended, so that nothing writes into it
// after the call returns).
type DirectReceiver interface {
	RecvInto(ctx context.Context, peer int, buf []byte, dst func(Header) []byte) (Header, []byte, error)
}

// ApplyReceiver is an optional Transport extension for transports whose frames sit in memory
// the receiver can read in place (shared memory): RecvApply is RecvInto, except that once a
// data frame's header is read, apply(h) may return a function that consumes the payload
// where it lies. The transport then calls it with consecutive parts of the payload — p holds
// the payload's bytes [off, off+len(p)) — instead of copying the payload anywhere, and returns
// the frame with a nil payload. Every part but the last is a multiple of ApplyAlign bytes, so
// a part holds whole elements of any wire type. p is only valid during the call: the
// function must not keep it, and must return promptly (it runs on the receiving goroutine,
// and the sender may be waiting for the room). The Ring uses it to reduce (or copy) a piece
// straight from the transport's memory into the caller's buffer: no intermediate buffer, one
// pass over the data. If the frame breaks off part-way (an error), some parts may have been
// applied. apply(h) returning nil means: receive as RecvInto with no destination.
type ApplyReceiver interface {
	RecvApply(ctx context.Context, peer int, buf []byte, apply func(Header) func(off int, p []byte)) (Header, []byte, error)
}

// ApplyAlign is the granularity of ApplyReceiver's parts: a cache line, a multiple of every
// element size.
const ApplyAlign = 64
