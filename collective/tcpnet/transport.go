package tcpnet

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
)

// Dial retry backoff: a peer that is not listening yet is usually a process a few hundred
// milliseconds behind this one, so start fast and cap the pause well under a second.
const (
	dialBackoffMin = 10 * time.Millisecond
	dialBackoffMax = 500 * time.Millisecond
)

var (
	_ collective.Transport = (*transport)(nil)
	_ Connector            = (*transport)(nil)
)

// Connector is implemented by the Transports this package makes: Connect dials the given
// peers now instead of on the first Send, so a caller that wants the ring's links up before
// the first collective (and a dead neighbour reported at setup) can have them.
type Connector interface {
	Connect(ctx context.Context, peers ...int) error
}

// transport is one rank's collective.Transport for one job.
type transport struct {
	l      *Listener
	log    *zap.Logger
	cfg    Config
	job    string
	rank   int
	size   int
	addrs  []string
	secret []byte
	dialer net.Dialer
	done   chan struct{}  // closed by Close
	wg     sync.WaitGroup // frame finishers (see finishFrame)

	out []*outConn // by peer; nil at this rank
	in  []*inConn  // by peer; nil at this rank

	mu struct {
		sync.Mutex
		closed bool
		conns  map[net.Conn]struct{} // every connection this transport owns, closed by Close
	}
	closeOnce sync.Once
}

// outConn is the connection this rank dialled to one peer, for Send.
type outConn struct {
	// sem is the send lock, a channel rather than a sync.Mutex so that waiting for it
	// honours the caller's ctx and Close. It also guards every field below.
	sem   chan struct{}
	conn  net.Conn // nil until the first Send dials
	err   error    // set once the connection failed; returned by every later Send
	watch ctxWatch
	hdr   [collective.HeaderSize]byte
	// bufs and vec hold the writev vector; kept here so Send does not allocate one per frame.
	bufs [2][]byte
	vec  net.Buffers
}

// inConn is the connection a peer dialled to this rank, for Recv.
//
// A dialler whose ctx ends in the middle of its handshake closes its connection, and this
// side may already have adopted it. Such a connection ends without delivering a byte (the
// dialler sends data only after a complete handshake), and the dialler's next Send dials
// again. So while the current connection has delivered nothing, a newer verified connection
// from the peer is accepted as next, and Recv switches to it once the current one has ended
// empty: nothing is lost, since an ended connection has nothing left to read. Once a
// connection has delivered data it is the peer's for good and further ones are refused.
type inConn struct {
	arrived chan struct{} // closed once the first connection is installed
	used    atomic.Bool   // conn has delivered bytes after the handshake

	// adoptMu serialises adopt for this peer: answering a connection takes a moment, and a
	// second one must see the outcome of the first.
	adoptMu sync.Mutex

	// Guarded by transport.mu.
	conn net.Conn // the connection Recv reads; set before arrived closes
	next net.Conn // a newer connection, read once conn has ended without delivering data

	// Recv's own (Recv for a peer runs in one goroutine at a time).
	err   error // set once conn failed; final unless conn delivered nothing and next replaces it
	watch ctxWatch
	fr    frameReader
}

func newTransport(l *Listener, g Group) *transport {
	t := &transport{
		l:      l,
		log:    l.log,
		cfg:    l.cfg,
		job:    g.Job,
		rank:   g.Rank,
		size:   len(g.Addrs),
		addrs:  append([]string(nil), g.Addrs...),
		secret: append([]byte(nil), g.Secret...),
		dialer: net.Dialer{KeepAliveConfig: keepAlive(l.cfg)},
		done:   make(chan struct{}),
		out:    make([]*outConn, len(g.Addrs)),
		in:     make([]*inConn, len(g.Addrs)),
	}
	t.mu.conns = make(map[net.Conn]struct{})
	for p := range g.Addrs {
		if p == g.Rank {
			continue
		}
		t.out[p] = &outConn{sem: make(chan struct{}, 1)}
		t.in[p] = &inConn{arrived: make(chan struct{})}
	}
	return t
}

func (t *transport) Rank() int { return t.rank }
func (t *transport) Size() int { return t.size }

func (t *transport) Addr(r int) string {
	if r < 0 || r >= len(t.addrs) {
		return ""
	}
	return t.addrs[r]
}

// Close closes every connection of the transport, which unblocks every Send and Recv with
// collective.ErrClosed, and unregisters it from its listener. Safe to call twice.
func (t *transport) Close() error {
	t.closeOnce.Do(func() {
		t.mu.Lock()
		t.mu.closed = true
		close(t.done)
		conns := t.mu.conns
		t.mu.conns = nil
		t.mu.Unlock()
		for c := range conns {
			closeConn(c)
		}
		for p := range t.out {
			if t.out[p] != nil {
				t.out[p].watch.close()
				t.in[p].watch.close()
			}
		}
		t.wg.Wait()
		t.l.unregister(t)
	})
	return nil
}

func (t *transport) closed() bool {
	select {
	case <-t.done:
		return true
	default:
		return false
	}
}

// own records c as the transport's, so Close closes it; false (and c closed) if the transport
// is already closed.
func (t *transport) own(c net.Conn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.mu.closed {
		closeConn(c)
		return false
	}
	t.mu.conns[c] = struct{}{}
	return true
}

func (t *transport) checkPeer(op string, peer int) error {
	if peer < 0 || peer >= t.size || peer == t.rank {
		return fmt.Errorf("tcpnet: %s rank %d: not a peer of rank %d in a group of %d", op, peer, t.rank, t.size)
	}
	return nil
}

func (t *transport) errClosed(op string, peer int) error {
	return fmt.Errorf("tcpnet: %s rank %d: %w", op, peer, collective.ErrClosed)
}

// Send writes the frame on the connection to peer, dialling it first if this is the first
// Send to peer. It returns once the kernel holds every byte, so payload may be reused.
func (t *transport) Send(ctx context.Context, peer int, h collective.Header, payload []byte) error {
	if err := t.checkPeer("send to", peer); err != nil {
		return err
	}
	if int(h.Length) != len(payload) {
		return fmt.Errorf("tcpnet: send to rank %d: %w: header length %d, payload of %d bytes",
			peer, collective.ErrProtocol, h.Length, len(payload))
	}
	if h.Kind == collective.KindHello {
		return fmt.Errorf("tcpnet: send to rank %d: %w: hello frames belong to the handshake", peer, collective.ErrProtocol)
	}
	if int(h.Src) != t.rank {
		return fmt.Errorf("tcpnet: send to rank %d: %w: frame claims source rank %d, this is rank %d",
			peer, collective.ErrProtocol, h.Src, t.rank)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("tcpnet: send to rank %d: %w", peer, err)
	}
	o := t.out[peer]
	select {
	case o.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("tcpnet: send to rank %d: waiting for the connection: %w", peer, ctx.Err())
	case <-t.done:
		return t.errClosed("send to", peer)
	}
	return t.sendLocked(ctx, o, peer, h, payload)
}

// sendLocked is Send with the send lock held; it releases the lock, or hands it to a
// finishFrame goroutine.
func (t *transport) sendLocked(ctx context.Context, o *outConn, peer int, h collective.Header, payload []byte) error {
	handedOff := false
	defer func() {
		if !handedOff {
			<-o.sem
		}
	}()
	if t.closed() {
		return t.errClosed("send to", peer)
	}
	if o.err != nil {
		return o.err
	}
	collective.PutHeader(o.hdr[:], h)
	// Check our own frame the way the receiver will, so a bad header fails here, naming
	// the call, instead of failing the peer's connection. 40 bytes: cheap.
	if _, err := collective.ParseHeader(o.hdr[:]); err != nil {
		return fmt.Errorf("tcpnet: send to rank %d: %w", peer, err)
	}
	if o.conn == nil {
		c, err := t.dial(ctx, peer)
		if err != nil {
			return err
		}
		o.conn = c
		o.watch.init(c.SetWriteDeadline)
	}
	o.watch.arm(ctx)
	o.bufs[0], o.bufs[1] = o.hdr[:], payload
	o.vec = o.bufs[:]
	n64, err := o.vec.WriteTo(o.conn)
	// Drop the reference to the caller's payload: it is theirs again.
	o.bufs[1], o.vec = nil, nil
	if err == nil {
		return nil
	}
	if t.closed() {
		return t.errClosed("send to", peer)
	}
	n := int(n64)
	if cerr := ctxErr(ctx, err); cerr != nil && t.cfg.TLS != nil {
		// A TLS connection whose write was cut short is unusable (crypto/tls makes every
		// write error permanent: the record in flight cannot be resumed), so the frame
		// cannot be finished as on plain TCP; the connection is given up.
		o.err = &collective.PeerError{Rank: peer, Addr: t.addrs[peer], Err: fmt.Errorf(
			"%w: a send cut short by its context (%v) ends a TLS connection", collective.ErrPeerGone, cerr)}
		closeConn(o.conn)
		return fmt.Errorf("tcpnet: send to rank %d: %w (the TLS connection is closed: a cut-short write cannot be resumed)", peer, cerr)
	} else if cerr != nil {
		if n > 0 {
			// Part of the frame is on the wire. Rather than leave the stream out of step,
			// finish the frame in the background from a copy, so the payload is the caller's
			// again at once and the connection stays usable.
			rest := make([]byte, 0, collective.HeaderSize+len(payload)-n)
			if n < collective.HeaderSize {
				rest = append(append(rest, o.hdr[n:]...), payload...)
			} else {
				rest = append(rest, payload[n-collective.HeaderSize:]...)
			}
			t.mu.Lock()
			if t.mu.closed { // Close is waiting for finishers: start none after it
				t.mu.Unlock()
				return t.errClosed("send to", peer)
			}
			t.wg.Add(1)
			t.mu.Unlock()
			handedOff = true
			go t.finishFrame(o, peer, rest)
			return fmt.Errorf("tcpnet: send to rank %d: %w (the frame, %d of %d bytes out, is being finished in the background)",
				peer, cerr, n, collective.HeaderSize+len(payload))
		}
		return fmt.Errorf("tcpnet: send to rank %d: %w", peer, cerr)
	}
	o.err = &collective.PeerError{Rank: peer, Addr: t.addrs[peer], Err: fmt.Errorf("%w: send: %w", collective.ErrPeerGone, err)}
	closeConn(o.conn)
	return o.err
}

// finishFrame writes rest, the unsent tail of a frame whose Send was cut short by its ctx,
// within Config.FinishTimeout, and then releases the send lock it inherited. If the peer does
// not take it in time the connection is given up, since the stream cannot be resumed.
func (t *transport) finishFrame(o *outConn, peer int, rest []byte) {
	defer t.wg.Done()
	defer func() { <-o.sem }()
	// No caller's ctx governs this write; a late callback of the cut-short ctx must not
	// interrupt it.
	o.watch.override(time.Now().Add(t.cfg.FinishTimeout))
	_, err := o.conn.Write(rest)
	if err == nil {
		o.watch.override(time.Time{})
		return
	}
	if t.closed() {
		return
	}
	o.err = &collective.PeerError{Rank: peer, Addr: t.addrs[peer], Err: fmt.Errorf(
		"%w: finishing a frame cut short by a cancelled send (%d bytes left): %w", collective.ErrPeerGone, len(rest), err)}
	closeConn(o.conn)
	t.log.Warn("tcpnet: gave up a connection", zap.String("job", t.job), zap.Int("rank", t.rank),
		zap.Int("peer", peer), zap.String("addr", t.addrs[peer]), zap.Error(err))
}

// Connect dials every peer in peers that is not connected yet, concurrently, and returns the
// failures joined (each a *collective.PeerError naming its peer).
func (t *transport) Connect(ctx context.Context, peers ...int) error {
	for _, p := range peers {
		if err := t.checkPeer("connect to", p); err != nil {
			return err
		}
	}
	errs := make([]error, len(peers))
	var wg sync.WaitGroup
	for i, p := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = t.connect(ctx, p)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (t *transport) connect(ctx context.Context, peer int) error {
	o := t.out[peer]
	select {
	case o.sem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("tcpnet: connect to rank %d: %w", peer, ctx.Err())
	case <-t.done:
		return t.errClosed("connect to", peer)
	}
	defer func() { <-o.sem }()
	if t.closed() {
		return t.errClosed("connect to", peer)
	}
	if o.err != nil {
		return o.err
	}
	if o.conn != nil {
		return nil
	}
	c, err := t.dial(ctx, peer)
	if err != nil {
		return err
	}
	o.conn = c
	o.watch.init(c.SetWriteDeadline)
	return nil
}

// Recv reads the next frame from peer into buf. A frame larger than buf is an error that
// leaves the connection failed (its payload is not read; the stream cannot be resumed). A
// Recv cut short by its ctx keeps what it read of a frame, and the next Recv resumes it.
func (t *transport) Recv(ctx context.Context, peer int, buf []byte) (collective.Header, []byte, error) {
	return t.RecvInto(ctx, peer, buf, nil)
}

var _ collective.DirectReceiver = (*transport)(nil)

// RecvInto is Recv, except that a data frame's payload goes to dst(h) when dst returns a
// slice of exactly its length: the payload is read from the socket straight into its final
// place (collective.DirectReceiver).
func (t *transport) RecvInto(ctx context.Context, peer int, buf []byte, dst func(collective.Header) []byte) (collective.Header, []byte, error) {
	if err := t.checkPeer("recv from", peer); err != nil {
		return collective.Header{}, nil, err
	}
	if err := ctx.Err(); err != nil {
		return collective.Header{}, nil, fmt.Errorf("tcpnet: recv from rank %d: %w", peer, err)
	}
	ic := t.in[peer]
	select {
	case <-ic.arrived:
	case <-ctx.Done():
		return collective.Header{}, nil, fmt.Errorf("tcpnet: recv from rank %d: waiting for it to connect: %w", peer, ctx.Err())
	case <-t.done:
		return collective.Header{}, nil, t.errClosed("recv from", peer)
	}
	for {
		if t.closed() {
			return collective.Header{}, nil, t.errClosed("recv from", peer)
		}
		conn := t.current(ic)
		if ic.err != nil {
			return collective.Header{}, nil, ic.err
		}
		ic.watch.arm(ctx)
		h, payload, err := ic.fr.read(conn, buf, dst)
		if !ic.used.Load() && (err == nil || ic.fr.hdrN > 0 || ic.fr.inFrame) {
			ic.used.Store(true)
		}
		if err == nil {
			if int(h.Src) == peer && h.Kind != collective.KindHello {
				return h, payload, nil
			}
			err = fmt.Errorf("%w: frame of kind %d from source rank %d on rank %d's connection",
				collective.ErrProtocol, h.Kind, h.Src, peer)
		}
		if t.closed() {
			return collective.Header{}, nil, t.errClosed("recv from", peer)
		}
		if cerr := ctxErr(ctx, err); cerr != nil {
			// The frame reader kept whatever part of a frame arrived; the next Recv resumes it.
			return collective.Header{}, nil, fmt.Errorf("tcpnet: recv from rank %d: %w", peer, cerr)
		}
		if errors.Is(err, collective.ErrProtocol) {
			ic.err = &collective.PeerError{Rank: peer, Addr: t.addrs[peer], Err: fmt.Errorf("%w (connection closed)", err)}
		} else {
			ic.err = &collective.PeerError{Rank: peer, Addr: t.addrs[peer], Err: fmt.Errorf("%w: %w", collective.ErrPeerGone, err)}
		}
		closeConn(conn)
		if !ic.used.Load() && t.replaced(ic) {
			continue // the connection ended empty and a newer one has arrived: read that
		}
		return collective.Header{}, nil, ic.err
	}
}

// current returns the connection Recv should read, first switching to the newer connection
// from the peer if the current one has failed without delivering data (see inConn).
func (t *transport) current(ic *inConn) net.Conn {
	t.mu.Lock()
	defer t.mu.Unlock()
	if ic.next != nil && ic.err != nil && !ic.used.Load() {
		old := ic.conn
		ic.conn, ic.next = ic.next, nil
		ic.err = nil
		ic.fr = frameReader{}
		ic.watch.init(ic.conn.SetReadDeadline)
		if t.mu.conns != nil {
			delete(t.mu.conns, old)
		}
		closeConn(old)
	}
	return ic.conn
}

func (t *transport) replaced(ic *inConn) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return ic.next != nil
}

// dial connects to peer and runs the dialler's side of the handshake, retrying while the
// peer refuses connections or does not answer, until ctx or Config.DialTimeout ends.
func (t *transport) dial(ctx context.Context, peer int) (net.Conn, error) {
	addr := t.addrs[peer]
	dctx, cancel := context.WithTimeout(ctx, t.cfg.DialTimeout)
	defer cancel()
	backoff := dialBackoffMin
	var last error
	attempt := 0
	for {
		attempt++
		c, err := t.dialOnce(dctx, peer, addr)
		if err == nil {
			return c, nil
		}
		last = err
		if t.closed() {
			return nil, t.errClosed("dial", peer)
		}
		// A peer that answers with a hello we cannot verify will not improve by retrying.
		if errors.Is(err, collective.ErrAuth) || errors.Is(err, collective.ErrProtocol) {
			return nil, &collective.PeerError{Rank: peer, Addr: addr, Err: fmt.Errorf("dial: %w", err)}
		}
		tm := time.NewTimer(backoff)
		select {
		case <-tm.C:
		case <-dctx.Done():
			tm.Stop()
			if cerr := ctx.Err(); cerr != nil {
				last = fmt.Errorf("%w (last attempt: %v)", cerr, last)
			}
			return nil, &collective.PeerError{Rank: peer, Addr: addr, Err: fmt.Errorf(
				"%w: dial failed after %d attempts: %w", collective.ErrPeerGone, attempt, last)}
		case <-t.done:
			tm.Stop()
			return nil, t.errClosed("dial", peer)
		}
		backoff = min(2*backoff, dialBackoffMax)
	}
}

func (t *transport) dialOnce(ctx context.Context, peer int, addr string) (net.Conn, error) {
	c, err := t.dialer.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	if !t.own(c) {
		return nil, t.errClosed("dial", peer)
	}
	raw := c // what own registered; c may become its TLS wrapping
	fail := func(err error) (net.Conn, error) {
		t.disown(raw)
		return nil, err
	}
	if err := tune(c, t.cfg); err != nil {
		return fail(err)
	}
	// Bound the handshake by HandshakeTimeout and ctx, and let ctx's cancellation cut it short.
	deadline := time.Now().Add(t.cfg.HandshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	if err := c.SetDeadline(deadline); err != nil {
		return fail(err)
	}
	if t.cfg.TLS != nil {
		// c stays registered (own) as the raw connection, so fail and Close close it; the
		// caller gets the TLS connection.
		tc := tls.Client(c, t.cfg.TLS.Client)
		if err := tc.HandshakeContext(ctx); err != nil {
			if ctx.Err() == nil && tlsRefused(err) {
				// A certificate refused on either side stays refused: ErrAuth stops the retries.
				err = fmt.Errorf("%w: %w", collective.ErrAuth, err)
			}
			return fail(fmt.Errorf("TLS handshake with %s: %w", addr, err))
		}
		c = tc
	}
	// ctx's end interrupts the handshake, but not a connection that has completed it: a
	// dialler that drops a connection the peer has already adopted makes the peer wait for
	// a replacement (see inConn), so once the answering hello verifies, the connection is kept.
	var hs struct {
		sync.Mutex
		done bool
	}
	stop := context.AfterFunc(ctx, func() {
		hs.Lock()
		if !hs.done {
			_ = c.SetDeadline(aLongTimeAgo)
		}
		hs.Unlock()
	})
	defer stop()
	if err := writeHello(c, t.secret, t.job, t.rank, t.size); err != nil {
		return fail(err)
	}
	h, hello, err := readHello(c)
	if err != nil {
		if t.cfg.TLS != nil && tlsRefused(err) {
			// Under TLS 1.3 the server checks our certificate after our side of the
			// handshake is done, so its refusal arrives here, as an alert.
			return fail(fmt.Errorf("%w: TLS: %s refused this node's certificate: %w", collective.ErrAuth, addr, err))
		}
		return fail(fmt.Errorf("waiting for the answering hello (peer refused us, or is not running job %q): %w", t.job, err))
	}
	rank, err := collective.VerifyHello(t.secret, t.job, t.size, hello, time.Now())
	if err != nil {
		return fail(fmt.Errorf("answering hello: %w", err))
	}
	if rank != peer || int(h.Src) != peer {
		return fail(fmt.Errorf("%w: %s answered as rank %d (frame says %d), expected rank %d", collective.ErrAuth, addr, rank, h.Src, peer))
	}
	hs.Lock()
	hs.done = true
	hs.Unlock()
	if err := c.SetDeadline(time.Time{}); err != nil {
		return fail(err)
	}
	t.log.Debug("tcpnet: connected", zap.String("job", t.job), zap.Int("rank", t.rank),
		zap.Int("peer", peer), zap.String("addr", addr))
	return c, nil
}

// closeConn closes c at once: a TLS connection's socket is closed without the close_notify
// alert, whose write could wait up to 5 s on a peer that has stopped reading. A data
// connection is only ever closed when it is done with or has failed, so the alert would tell
// the peer nothing that the closed socket does not.
func closeConn(c net.Conn) {
	if tc, ok := c.(*tls.Conn); ok {
		_ = tc.NetConn().Close()
		return
	}
	_ = c.Close()
}

// tlsRefused reports whether a TLS connection failed because one end refused the other's
// certificate (a verification error here, or the peer's alert), which retrying cannot fix,
// rather than on the network (resets, timeouts, EOF).
func tlsRefused(err error) bool {
	var op *net.OpError
	if errors.As(err, &op) {
		return op.Op == "remote error" // crypto/tls's wrapping of a received alert
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, os.ErrDeadlineExceeded) ||
		errors.Is(err, net.ErrClosed) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, context.Canceled) ||
		errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var verr *tls.CertificateVerificationError
	return errors.As(err, &verr) || !isNetError(err)
}

func isNetError(err error) bool {
	var ne net.Error
	return errors.As(err, &ne)
}

// disown closes c and forgets it.
func (t *transport) disown(c net.Conn) {
	t.mu.Lock()
	delete(t.mu.conns, c)
	t.mu.Unlock()
	closeConn(c)
}

// adopt takes a verified connection from peer for Recv: it answers with this rank's hello
// and installs it, or keeps it as the next connection while the current one has delivered
// nothing (see inConn). The connection's deadline is the handshake's until then.
func (t *transport) adopt(peer int, c net.Conn, remote string, deadline time.Time) error {
	ic := t.in[peer]
	ic.adoptMu.Lock()
	defer ic.adoptMu.Unlock()
	t.mu.Lock()
	if t.mu.closed {
		t.mu.Unlock()
		return collective.ErrClosed
	}
	if ic.conn != nil && ic.used.Load() {
		t.mu.Unlock()
		return fmt.Errorf("%w: already connected to this rank; a second connection claiming it is refused", collective.ErrAuth)
	}
	t.mu.conns[c] = struct{}{}
	t.mu.Unlock()

	err := probeHungUp(c, deadline)
	if err == nil {
		err = writeHello(c, t.secret, t.job, t.rank, t.size)
	}
	if err == nil {
		err = c.SetDeadline(time.Time{})
	}
	t.mu.Lock()
	if err == nil && t.mu.closed {
		err = collective.ErrClosed
	}
	if err != nil {
		t.mu.Unlock()
		t.disown(c)
		return err
	}
	replacing := ic.conn != nil
	if !replacing {
		ic.conn = c
		ic.watch.init(c.SetReadDeadline)
		close(ic.arrived)
	} else {
		if ic.next != nil { // the newest attempt wins
			delete(t.mu.conns, ic.next)
			closeConn(ic.next)
		}
		ic.next = c
	}
	t.mu.Unlock()
	t.log.Debug("tcpnet: accepted", zap.String("job", t.job), zap.Int("rank", t.rank),
		zap.Int("peer", peer), zap.String("remote", remote), zap.Bool("next", replacing))
	return nil
}

// probeWait is how long adopt looks for a dialler that hung up while its hello waited for
// its job to register here. Adopting such a connection would make Recv report the peer gone
// although it is merely about to dial again.
const probeWait = time.Millisecond

// probeHungUp fails if the dialler has already closed c (or sent something before our
// answer, which it must not), and restores the handshake deadline.
func probeHungUp(c net.Conn, deadline time.Time) error {
	if err := c.SetReadDeadline(time.Now().Add(probeWait)); err != nil {
		return err
	}
	var b [1]byte
	n, err := c.Read(b[:])
	switch {
	case n > 0:
		return fmt.Errorf("%w: the dialler sent data before the answering hello", collective.ErrProtocol)
	case err != nil && !errors.Is(err, os.ErrDeadlineExceeded):
		return fmt.Errorf("the dialler hung up during the handshake: %w", err)
	}
	return c.SetReadDeadline(deadline)
}
