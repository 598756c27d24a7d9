package grpcnet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/status"

	"github.com/qvd/qvd/collective"
)

// Group describes one group of ranks (a training job) once the roster is known: the
// collective.Roster (Addrs are the ranks' gRPC addresses) and how to dial them.
type Group struct {
	collective.Roster
	// DialOptions are applied after DialOptions() (credentials later: TLS).
	DialOptions []grpc.DialOption
	// Dialer, if set, opens the connections to peers instead of plain TCP (an in-memory
	// listener in tests, another network). A grpc.WithContextDialer in DialOptions is
	// overridden: the transport must keep hold of its connections, because in rare failures
	// it has to cut one to honour Send's contract (see Send).
	Dialer func(ctx context.Context, addr string) (net.Conn, error)
}

// inQueue and inQueueBytes bound the received frames that may wait for Recv per peer: at
// most eight, and no more than 16 MiB once one is queued (frames may be up to 64 MiB). Beyond
// that the reader stops reading and HTTP/2 flow control holds the sender back; the queue
// only decouples gRPC's delivery from the caller's pace.
const (
	inQueue      = 8
	inQueueBytes = 16 << 20
)

type transport struct {
	hub      *Hub
	tune     tuning
	job      string
	rank     int
	size     int
	secret   []byte
	dialOpts []grpc.DialOption
	dial     func(ctx context.Context, addr string) (net.Conn, error)
	peers    []*peer // nil at this process's rank
	beat     []byte  // the heartbeat frame this rank sends back on incoming streams
	// copySends selects the alternative to lending payloads that bench_test.go measures:
	// copy each payload into a buffer from gRPC's pool, which gRPC frees when written, and
	// return as soon as SendMsg does. Benchmarks only.
	copySends bool

	// base is the parent of every outgoing stream's context; Close cancels it.
	base   context.Context
	cancel context.CancelFunc
	closed chan struct{}
	once   sync.Once
	wg     sync.WaitGroup // outgoing stream watchers and incoming stream readers

	mu struct {
		sync.Mutex
		closed  bool
		closing bool // Close has begun: no new Sends (see linger)
	}
}

var _ collective.Transport = (*transport)(nil)

// peer is everything about one other rank. The two directions are one unit: a failure of
// either (stream broken, peer silent, bad frame) fails both, because frames lost in one
// direction leave the collective that pairs them unable to finish.
type peer struct {
	t    *transport
	rank int
	addr string
	gone chan struct{} // closed when the peer failed; err says why

	mu struct {
		sync.Mutex
		err        error
		cancelOut  context.CancelFunc // resets the outgoing stream
		inAttached bool               // an incoming stream was accepted (at most one ever is)
	}
	out outLink
	in  inLink
}

// outLink is the outgoing stream to a peer.
type outLink struct {
	// sem serialises Sends (gRPC forbids concurrent SendMsg on a stream, and frames must not
	// interleave) and the opening of the stream. Fields below are guarded by holding it.
	sem    chan struct{}
	cc     *grpc.ClientConn
	stream grpc.ClientStream
	slot   *sendSlot
	copied copiedFrame // copySends only
	// watched is closed when the goroutine watching the stream (link.go, watch) has
	// stopped: the stream ended and the peer's failure is recorded.
	watched chan struct{}

	conns struct { // the raw connections dialled for cc, so that they can be cut
		sync.Mutex
		list []net.Conn
	}
}

// inLink is the incoming stream from a peer: frames received and not yet taken by Recv, and
// the spare frames the reader fills next (inQueue+2 in all: the queue, one being read, one
// being copied out by Recv, so returning a frame to free never blocks).
type inLink struct {
	frames chan *inFrame
	free   chan *inFrame
	queued atomic.Int64  // payload bytes in frames
	taken  chan struct{} // Recv took a frame: the reader may go on if it waits on inQueueBytes
}

func newTransport(h *Hub, g Group) *transport {
	t := &transport{
		hub: h, tune: h.tune, job: g.Job, rank: g.Rank, size: len(g.Addrs),
		secret:   append([]byte(nil), g.Secret...),
		dialOpts: append(DialOptions(), g.DialOptions...),
		dial:     g.Dialer,
		peers:    make([]*peer, len(g.Addrs)),
		closed:   make(chan struct{}),
	}
	if t.dial == nil {
		var d net.Dialer
		t.dial = func(ctx context.Context, addr string) (net.Conn, error) { return d.DialContext(ctx, "tcp", addr) }
	}
	t.base, t.cancel = context.WithCancel(context.Background())
	t.beat = newRawFrame(collective.Header{Kind: collective.KindHello, Src: uint16(g.Rank)}, nil).b
	for r, addr := range g.Addrs {
		if r == g.Rank {
			continue
		}
		p := &peer{t: t, rank: r, addr: addr, gone: make(chan struct{})}
		p.out.sem = make(chan struct{}, 1)
		p.out.slot = newSendSlot()
		p.in.frames = make(chan *inFrame, inQueue)
		p.in.free = make(chan *inFrame, inQueue+2)
		p.in.taken = make(chan struct{}, 1)
		for i := 0; i < inQueue+2; i++ {
			p.in.free <- new(inFrame)
		}
		t.peers[r] = p
	}
	return t
}

func (t *transport) Rank() int { return t.rank }
func (t *transport) Size() int { return t.size }

func (t *transport) Addr(r int) string {
	if r < 0 || r >= t.size || t.peers[r] == nil {
		return ""
	}
	return t.peers[r].addr
}

func (t *transport) peer(r int, what string) (*peer, error) {
	if r < 0 || r >= t.size {
		return nil, fmt.Errorf("grpcnet: %s rank %d: not in a group of %d", what, r, t.size)
	}
	if r == t.rank {
		return nil, fmt.Errorf("grpcnet: %s rank %d: that is this process's own rank", what, r)
	}
	return t.peers[r], nil
}

// Send transmits one frame to peer. Payloads above smallPayload are not copied: gRPC is
// lent the caller's bytes (sendSlot), and Send returns once gRPC has handed them back, that
// is once its writer has copied the last of them into the connection's write buffer. Until
// then the frame is queued behind flow control, so a peer that does not read makes Send
// wait (up to its ctx), as a full socket would.
//
// If Send must return before gRPC gave the bytes back, the frame can be neither recalled nor
// left to gRPC, which would read the caller's buffer after Send returned and could deliver a
// frame whose tail the caller had already overwritten. When only the ctx ended, Send first
// waits up to releaseGrace for the frame to finish (a moving frame does in microseconds);
// a frame still stuck after that, or any frame when the peer failed or the transport
// closed, has its stream reset, and if gRPC does not drop it within releaseGrace (its
// writer is blocked on a full socket) Send closes the connection under it, after which
// nothing gRPC copies can reach the wire. The link to that peer then stays failed: later
// Sends and Recvs return the same *PeerError.
func (t *transport) Send(ctx context.Context, peerRank int, h collective.Header, payload []byte) error {
	p, err := t.peer(peerRank, "send to")
	if err != nil {
		return err
	}
	if err := checkOutgoing(t.rank, h, payload); err != nil {
		return fmt.Errorf("grpcnet: send to rank %d: %w", peerRank, err)
	}
	if t.isClosed() {
		return collective.ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("grpcnet: send to rank %d: %w", peerRank, err)
	}
	o := &p.out
	select {
	case o.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("grpcnet: send to rank %d: %w", peerRank, ctx.Err())
	case <-p.gone:
		return p.failure()
	case <-t.closed:
		return collective.ErrClosed
	}
	defer func() { <-o.sem }()
	select {
	case <-t.closed:
		return collective.ErrClosed
	case <-p.gone:
		return p.failure()
	default:
	}
	if t.isClosing() {
		return collective.ErrClosed
	}
	if o.stream == nil {
		if err := t.open(ctx, p); err != nil {
			return err
		}
	}

	if t.copySends {
		return t.sendCopy(p, h, payload)
	}
	s := o.slot
	collective.PutHeader(s.stage, h)
	s.load(payload)
	if err := o.stream.SendMsg(s); err != nil {
		// A failed SendMsg has dropped gRPC's references to the slot (signalling a release
		// this Send will not consume: the slot is replaced; the link is failed anyway).
		o.slot = newSendSlot()
		return t.streamBroke(p, err)
	}
	select {
	case <-s.released:
		s.forget()
		return nil
	case <-ctx.Done():
		err = fmt.Errorf("grpcnet: send to rank %d: %w", peerRank, ctx.Err())
	case <-p.gone:
		err = nil
	case <-t.closed:
		err = collective.ErrClosed
	}
	return t.abandon(p, s, err)
}

// sendCopy sends a copy of the frame in a buffer gRPC frees (see copySends).
func (t *transport) sendCopy(p *peer, h collective.Header, payload []byte) error {
	pool := mem.DefaultBufferPool()
	b := pool.Get(collective.HeaderSize + len(payload))
	collective.PutHeader(*b, h)
	copy((*b)[collective.HeaderSize:], payload)
	p.out.copied.buf = mem.NewBuffer(b, pool)
	if err := p.out.stream.SendMsg(&p.out.copied); err != nil {
		return t.streamBroke(p, err)
	}
	return nil
}

// streamBroke handles a SendMsg error: the outgoing stream ended. gRPC reports io.EOF here
// and the reason (the peer refused a frame, closed, vanished) to RecvMsg, so let the watcher
// record that first.
func (t *transport) streamBroke(p *peer, err error) error {
	wait := time.NewTimer(t.tune.releaseGrace)
	select {
	case <-p.out.watched:
	case <-wait.C:
	}
	wait.Stop()
	p.fail(t.peerGone(p, fmt.Errorf("send: %w", err)))
	return p.failure()
}

// checkOutgoing refuses frames the receiver would refuse, before they can break the link.
func checkOutgoing(rank int, h collective.Header, payload []byte) error {
	if int(h.Length) != len(payload) {
		return fmt.Errorf("%w: header says %d payload bytes, payload has %d", collective.ErrProtocol, h.Length, len(payload))
	}
	if h.Kind == collective.KindHello {
		return fmt.Errorf("%w: hello frames belong to the handshake", collective.ErrProtocol)
	}
	if int(h.Src) != rank {
		return fmt.Errorf("%w: header names rank %d as sender, this is rank %d", collective.ErrProtocol, h.Src, rank)
	}
	var b [collective.HeaderSize]byte
	collective.PutHeader(b[:], h)
	_, err := collective.ParseHeader(b[:])
	return err
}

// abandon gives up on a frame gRPC still holds (see Send) and returns err, or the peer's
// failure when err is nil, or nil if the frame went out whole after all. The caller holds the
// link's sem.
func (t *transport) abandon(p *peer, s *sendSlot, err error) error {
	grace := time.NewTimer(t.tune.releaseGrace)
	defer grace.Stop()
	if err != nil && !errors.Is(err, collective.ErrClosed) {
		// Only the ctx ended. A frame that is moving comes back within a millisecond (the
		// Ring cancels a call's ctx as the call ends, often with its last frame still being
		// written); only one stuck behind flow control, to a peer that stopped reading, is
		// worth breaking the link for.
		select {
		case <-s.released:
			s.forget()
			return nil
		case <-grace.C:
			grace.Reset(t.tune.releaseGrace)
		case <-p.gone: // reset already
		case <-t.closed:
		}
		p.fail(t.peerGone(p, fmt.Errorf("a frame stuck for %v after its send was given up (%v) was abandoned",
			t.tune.releaseGrace, err)))
	}
	// The stream is reset now (by p.fail, or by Close cancelling every stream): gRPC drops
	// the frame and hands the bytes back unless its writer is stuck on a full socket.
	select {
	case <-s.released:
		s.forget()
	case <-grace.C:
		p.out.cut()
		p.out.slot = newSendSlot() // gRPC may still hold the old one: never reuse it
	}
	if err == nil {
		return p.failure()
	}
	return err
}

// cut closes the raw connections under the link's ClientConn.
func (o *outLink) cut() {
	o.conns.Lock()
	defer o.conns.Unlock()
	for _, c := range o.conns.list {
		_ = c.Close()
	}
	o.conns.list = nil
}

// Recv returns the next frame from peer, its payload copied into buf. Frames that arrived
// before the peer failed are still delivered, then the failure.
func (t *transport) Recv(ctx context.Context, peerRank int, buf []byte) (collective.Header, []byte, error) {
	return t.RecvInto(ctx, peerRank, buf, nil)
}

// RecvInto is Recv, except that a data frame's payload goes straight from gRPC's receive
// buffers to dst(h) when that names a slice of exactly its length (collective.DirectReceiver):
// all-gather and broadcast pieces then cost one copy instead of two.
func (t *transport) RecvInto(ctx context.Context, peerRank int, buf []byte, dst func(collective.Header) []byte) (collective.Header, []byte, error) {
	p, err := t.peer(peerRank, "receive from")
	if err != nil {
		return collective.Header{}, nil, err
	}
	if t.isClosed() {
		return collective.Header{}, nil, collective.ErrClosed
	}
	in := &p.in
	var f *inFrame
	select {
	case f = <-in.frames:
	default:
		select {
		case f = <-in.frames:
		case <-p.gone:
			select {
			case f = <-in.frames:
			default:
				return collective.Header{}, nil, p.failure()
			}
		case <-t.closed:
			return collective.Header{}, nil, collective.ErrClosed
		case <-ctx.Done():
			return collective.Header{}, nil, fmt.Errorf("grpcnet: receive from rank %d: %w", peerRank, ctx.Err())
		}
	}
	h := f.hdr
	in.queued.Add(-int64(h.Length))
	select {
	case in.taken <- struct{}{}:
	default:
	}
	if dst != nil && h.Kind == collective.KindData && h.Length > 0 {
		if d := dst(h); len(d) == int(h.Length) {
			buf = d
		}
	}
	if int(h.Length) > len(buf) {
		f.release()
		in.free <- f
		// The frame cannot be delivered whole and the ones after it belong to the same
		// call: the link is out of step, as on a raw stream.
		p.fail(&collective.PeerError{Rank: p.rank, Addr: p.addr, Err: fmt.Errorf(
			"%w: a frame of %d payload bytes for a receive buffer of %d", collective.ErrProtocol, h.Length, len(buf))})
		return h, nil, p.failure()
	}
	n := f.copyPayload(buf)
	f.release()
	in.free <- f
	return h, buf[:n], nil
}

// Close first lingers (see linger) so that frames already sent reach their peers, then resets
// every stream of the transport, unregisters it from its Hub and waits for its goroutines.
// Blocked Sends and Recvs return collective.ErrClosed. Safe to call twice.
func (t *transport) Close() error {
	t.once.Do(func() {
		t.linger()
		t.mu.Lock()
		t.mu.closed = true
		close(t.closed)
		t.mu.Unlock()
		t.hub.unregister(t)
		t.cancel()
		// Blocked Sends see closed and return (within releaseGrace); taking every sem
		// waits for them and keeps later Sends off the connections closed below.
		for _, p := range t.peers {
			if p != nil {
				p.out.sem <- struct{}{}
			}
		}
		var wg sync.WaitGroup
		for _, p := range t.peers {
			if p == nil || p.out.cc == nil {
				continue
			}
			// A graceful close sends GOAWAY, but waits up to 5 s for gRPC's writer if it is
			// stuck on a peer that stopped reading; cutting the connections frees it.
			closed := make(chan struct{})
			wg.Go(func() {
				stuck := time.NewTimer(t.tune.releaseGrace)
				defer stuck.Stop()
				select {
				case <-stuck.C:
					p.out.cut()
				case <-closed:
				}
			})
			wg.Go(func() {
				_ = p.out.cc.Close()
				close(closed)
				p.out.cut()
			})
		}
		wg.Wait()
		t.wg.Wait()
		for _, p := range t.peers {
			if p == nil {
				continue
			}
			for len(p.in.frames) > 0 {
				f := <-p.in.frames
				f.release()
				p.in.free <- f
			}
		}
	})
	return nil
}

// linger half-closes every open outgoing stream and waits, up to tune.linger, until each
// peer's Hub has read it to its end. gRPC delivers a stream's messages before its
// end-of-stream, so when linger returns every frame sent before Close has reached the peer's
// queue (where its Recv still finds it, even though the link then reports the peer gone).
// Without it, a rank that finishes the last collective of a job first and exits would reset
// its streams under frames its successor has not read yet, failing that rank's last call.
func (t *transport) linger() {
	t.mu.Lock()
	t.mu.closing = true
	t.mu.Unlock()
	deadline := time.NewTimer(t.tune.linger)
	defer deadline.Stop()
	var ends []<-chan struct{}
	for _, p := range t.peers {
		if p == nil {
			continue
		}
		select {
		case p.out.sem <- struct{}{}: // no Send in flight on this link
		case <-deadline.C:
			return
		}
		if p.out.stream != nil && p.failure() == nil {
			_ = p.out.stream.CloseSend()
			ends = append(ends, p.out.watched)
		}
		<-p.out.sem
	}
	for _, end := range ends {
		select {
		case <-end:
		case <-deadline.C:
			return
		}
	}
}

func (t *transport) isClosing() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.mu.closing
}

func (t *transport) isClosed() bool {
	select {
	case <-t.closed:
		return true
	default:
		return false
	}
}

// attach accepts the incoming stream from p; the reader that delivers it is counted in t.wg.
func (t *transport) attach(p *peer) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		return status.Errorf(codes.Unavailable, "grpcnet: rank %d closed its transport for job %q", t.rank, t.job)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.inAttached {
		return status.Errorf(codes.AlreadyExists, "grpcnet: rank %d of job %q already has a stream to rank %d", p.rank, t.job, t.rank)
	}
	p.mu.inAttached = true
	t.wg.Add(1)
	return nil
}

// streamEnded records that the incoming stream from p ended with err, unless the transport
// is closing anyway.
func (t *transport) streamEnded(p *peer, err error) {
	if t.isClosed() {
		return
	}
	p.fail(t.peerGone(p, fmt.Errorf("incoming stream: %w", err)))
}

func (t *transport) peerGone(p *peer, err error) error {
	return &collective.PeerError{Rank: p.rank, Addr: p.addr, Err: fmt.Errorf("%w: %w", collective.ErrPeerGone, err)}
}

// streamError classifies how an outgoing stream ended, from the status the peer's Hub
// returned.
func (t *transport) streamError(p *peer, err error) error {
	var kind error
	switch status.Code(err) {
	case codes.Unauthenticated, codes.PermissionDenied:
		kind = collective.ErrAuth
	case codes.InvalidArgument, codes.AlreadyExists:
		kind = collective.ErrProtocol
	default:
		kind = collective.ErrPeerGone
	}
	return &collective.PeerError{Rank: p.rank, Addr: p.addr, Err: fmt.Errorf("%w: %w", kind, err)}
}

// fail records the peer's first failure and resets its outgoing stream; the incoming
// stream's handler sees gone and ends that stream too.
func (p *peer) fail(err error) {
	p.mu.Lock()
	if p.mu.err != nil {
		p.mu.Unlock()
		return
	}
	p.mu.err = err
	close(p.gone)
	cancel := p.mu.cancelOut
	p.mu.Unlock()
	if cancel != nil {
		cancel()
	}
}

func (p *peer) failure() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mu.err
}
