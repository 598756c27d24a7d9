package tcpnet

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
)

// maxHandshakes bounds the accepted connections that have not yet been handed to a transport,
// so strangers opening connections cannot make the listener hold unbounded sockets and
// goroutines: each lives at most Config.HandshakeTimeout, and beyond this many new ones are
// closed at once.
const maxHandshakes = 256

// acceptRetry is the pause after a failed Accept (out of file descriptors, say) before the
// next, so the loop does not spin while the condition lasts.
const acceptRetry = 50 * time.Millisecond

// Listener is a process's data-plane listener. It accepts connections for every job whose
// Transport it made and routes each, by its verified hello, to that job's transport.
type Listener struct {
	cfg  Config
	log  *zap.Logger
	ln   net.Listener
	addr string
	done chan struct{} // closed by Close
	wg   sync.WaitGroup

	jobs collective.Jobs[*transport] // the transports made here, by job

	mu struct {
		sync.Mutex
		closed     bool
		handshakes map[net.Conn]struct{} // accepted, not yet handed to a transport
	}
}

// Listen opens this process's data-plane listener with DefaultConfig, at startup, so its
// address can be advertised. addr is host:port; port 0 picks a free one (see Addr).
func Listen(addr string, log *zap.Logger) (*Listener, error) {
	return ListenWith(addr, DefaultConfig(), log)
}

// ListenWith is Listen with a Config.
func ListenWith(addr string, cfg Config, log *zap.Logger) (*Listener, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("tcpnet: config: %w", err)
	}
	if log == nil {
		log = zap.NewNop()
	}
	lc := net.ListenConfig{KeepAliveConfig: keepAlive(cfg)}
	ln, err := lc.Listen(context.Background(), "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("tcpnet: listen on %s: %w", addr, err)
	}
	l := &Listener{cfg: cfg, log: log, ln: ln, addr: ln.Addr().String(), done: make(chan struct{})}
	l.mu.handshakes = make(map[net.Conn]struct{})
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

// Addr returns the address the listener is bound to (host:port).
func (l *Listener) Addr() string { return l.addr }

// Close stops accepting, drops connections still in their handshake, closes every Transport
// made from the listener, and waits for the listener's goroutines. Safe to call twice.
func (l *Listener) Close() error {
	l.mu.Lock()
	if l.mu.closed {
		l.mu.Unlock()
		return nil
	}
	l.mu.closed = true
	close(l.done)
	err := l.ln.Close()
	for c := range l.mu.handshakes {
		_ = c.Close()
	}
	l.mu.Unlock()
	for _, t := range l.jobs.Close() {
		_ = t.Close()
	}
	l.wg.Wait()
	if err != nil {
		return fmt.Errorf("tcpnet: closing listener %s: %w", l.addr, err)
	}
	return nil
}

// Group is one job's roster as the control plane hands it to a rank; Addrs are the ranks'
// data-plane addresses.
type Group = collective.Roster

// Transport creates this process's transport for g and registers it on the listener, so
// connections from g's other ranks are routed to it. It dials nobody: each peer is dialled on
// the first Send to it (see the package doc). Closing the transport unregisters it; a job
// has at most one transport per listener at a time.
func (l *Listener) Transport(ctx context.Context, g Group) (collective.Transport, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("tcpnet: transport for job %q: %w", g.Job, err)
	}
	if err := g.Validate(); err != nil {
		return nil, fmt.Errorf("tcpnet: transport for job %q: group: %w", g.Job, err)
	}
	t := newTransport(l, g)
	// Registering wakes the handshakes that arrived before this job did.
	if err := l.jobs.Register(g.Job, t); err != nil {
		return nil, fmt.Errorf("tcpnet: transport for job %q: listener %s: %w", g.Job, l.addr, err)
	}
	return t, nil
}

// unregister removes t (called by t.Close).
func (l *Listener) unregister(t *transport) { l.jobs.Unregister(t.job, t) }

func (l *Listener) acceptLoop() {
	defer l.wg.Done()
	for {
		c, err := l.ln.Accept()
		if err != nil {
			select {
			case <-l.done:
				return
			default:
			}
			l.log.Warn("tcpnet: accept failed", zap.String("listener", l.addr), zap.Error(err))
			tm := time.NewTimer(acceptRetry)
			select {
			case <-l.done:
				tm.Stop()
				return
			case <-tm.C:
			}
			continue
		}
		l.mu.Lock()
		if l.mu.closed {
			l.mu.Unlock()
			_ = c.Close()
			return
		}
		if len(l.mu.handshakes) >= maxHandshakes {
			l.mu.Unlock()
			l.log.Warn("tcpnet: refused data connection: too many handshakes in progress",
				zap.String("remote", c.RemoteAddr().String()), zap.Int("limit", maxHandshakes))
			_ = c.Close()
			continue
		}
		l.mu.handshakes[c] = struct{}{}
		l.wg.Add(1)
		l.mu.Unlock()
		go l.handshake(c)
	}
}

// handshake authenticates an accepted connection and hands it to its job's transport, or
// closes it and logs why.
func (l *Listener) handshake(c net.Conn) {
	defer l.wg.Done()
	remote := c.RemoteAddr().String()
	adopted := false
	defer func() {
		l.mu.Lock()
		delete(l.mu.handshakes, c)
		l.mu.Unlock()
		if !adopted {
			_ = c.Close()
		}
	}()
	refuse := func(err error) {
		l.log.Warn("tcpnet: refused data connection", zap.String("remote", remote),
			zap.String("listener", l.addr), zap.Error(err))
	}

	deadline := time.Now().Add(l.cfg.HandshakeTimeout)
	if err := c.SetDeadline(deadline); err != nil {
		refuse(fmt.Errorf("setting handshake deadline: %w", err))
		return
	}
	if err := tune(c, l.cfg); err != nil {
		refuse(err)
		return
	}
	// conn is c, or c wrapped in TLS; c stays the handle that Close and the deferred
	// cleanup close.
	conn := c
	if l.cfg.TLS != nil {
		tc := tls.Server(c, l.cfg.TLS.Server)
		if err := tc.Handshake(); err != nil { // bounded by the handshake deadline
			refuse(fmt.Errorf("%w: TLS handshake: %w", collective.ErrAuth, err))
			return
		}
		conn = tc
	}
	h, hello, err := readHello(conn)
	if err != nil {
		refuse(err)
		return
	}

	// Find the job whose secret verifies the hello. The peer may have learnt the roster
	// before this process registered the job, so wait for registrations until the deadline.
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for {
		ts, closed, changed := l.jobs.All()
		if closed {
			return
		}
		t, rank, verr := match(ts, h, hello)
		if t != nil {
			if err := t.adopt(rank, conn, remote, deadline); err != nil {
				refuse(fmt.Errorf("job %q rank %d: %w", t.job, rank, err))
				return
			}
			adopted = true
			return
		}
		if errors.Is(verr, collective.ErrProtocol) {
			refuse(verr)
			return
		}
		select {
		case <-changed:
		case <-l.done:
			return
		case <-timer.C:
			if verr == nil {
				verr = fmt.Errorf("%w: no job is registered on this listener", collective.ErrAuth)
			}
			refuse(fmt.Errorf("no job here accepts the hello within %v: %w", l.cfg.HandshakeTimeout, verr))
			return
		}
	}
}

// match returns the transport among ts whose secret verifies hello, and the rank the hello
// proves; otherwise the last verification error (nil if ts is empty).
func match(ts []*transport, h collective.Header, hello []byte) (*transport, int, error) {
	var last error
	now := time.Now()
	for _, t := range ts {
		rank, err := collective.VerifyHello(t.secret, t.job, t.size, hello, now)
		if err != nil {
			last = err
			continue
		}
		if int(h.Src) != rank {
			return nil, 0, fmt.Errorf("%w: hello frame from rank %d carries a hello for rank %d", collective.ErrProtocol, h.Src, rank)
		}
		if rank == t.rank {
			return nil, 0, fmt.Errorf("%w: job %q: a connection claiming this process's own rank %d", collective.ErrProtocol, t.job, rank)
		}
		return t, rank, nil
	}
	return nil, 0, last
}
