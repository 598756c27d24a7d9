package grpcnet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/qvd/qvd/collective"
)

// open opens the outgoing stream to p, retrying while p's Hub does not know the job yet (the
// peer may learn the roster a little after this process). Bounded by ctx; the caller holds
// p.out.sem. A ctx that ends leaves the link unopened, so a later Send tries again; a
// refusal (authentication, protocol) fails the peer for good.
func (t *transport) open(ctx context.Context, p *peer) error {
	o := &p.out
	if o.cc == nil {
		// gRPC connects when the first stream needs it. The dialer goes last so that the
		// transport always owns the raw connections (Group.Dialer replaces the network).
		opts := append(slices.Clone(t.dialOpts), grpc.WithContextDialer(o.dialer(t.dial)))
		cc, err := grpc.NewClient("passthrough:///"+p.addr, opts...)
		if err != nil {
			return fmt.Errorf("grpcnet: client for rank %d at %q: %w", p.rank, p.addr, err)
		}
		o.cc = cc
	}
	var last error
	for {
		err := t.handshake(ctx, p)
		switch {
		case err == nil:
			return nil
		case t.isClosed():
			return collective.ErrClosed
		case ctx.Err() != nil:
			if last == nil {
				last = err
			}
			return &collective.PeerError{Rank: p.rank, Addr: p.addr, Err: fmt.Errorf("opening a stream: %w (%v)", ctx.Err(), last)}
		case status.Code(err) == codes.NotFound:
			last = err
			wait := time.NewTimer(t.tune.retryEvery)
			select {
			case <-wait.C:
			case <-ctx.Done():
			case <-t.closed:
			case <-p.gone:
				wait.Stop()
				return p.failure()
			}
			wait.Stop()
		default:
			var pe *collective.PeerError
			if !errors.As(err, &pe) {
				err = t.streamError(p, err)
			}
			p.fail(err)
			return p.failure()
		}
	}
}

// handshake opens one stream to p and exchanges hellos: ours proves to p that we hold the
// job's secret, p's proves that the stream reached the rank we meant and was accepted.
// Receiving p's answer also commits the stream in gRPC, which then stops keeping sent
// messages for replay (see DialOptions).
func (t *transport) handshake(ctx context.Context, p *peer) error {
	o := &p.out
	sctx, cancel := context.WithCancel(t.base)
	sctx = metadata.AppendToOutgoingContext(sctx, jobKey, t.job)
	// The stream outlives this Send, so its context derives from the transport; the Send's
	// ctx bounds only the handshake.
	stop := context.AfterFunc(ctx, cancel)
	fail := func(err error) error {
		stop()
		cancel()
		return err
	}
	cs, err := o.cc.NewStream(sctx, &framesDesc.Streams[0], fullMethod,
		grpc.ForceCodecV2(frameCodec{}), grpc.WaitForReady(true))
	if err != nil {
		return fail(err)
	}
	hello := newRawFrame(collective.Header{Kind: collective.KindHello, Src: uint16(t.rank)},
		collective.NewHello(t.secret, t.job, t.rank, t.size, time.Now()))
	if err := cs.SendMsg(hello); err != nil && !errors.Is(err, io.EOF) {
		return fail(err)
	}
	// On io.EOF the stream failed and RecvMsg returns why.
	f := new(inFrame)
	if err := cs.RecvMsg(f); err != nil {
		return fail(err)
	}
	if err := t.checkAnswer(p, f); err != nil {
		return fail(err)
	}
	if !stop() { // ctx ended meanwhile and reset the stream
		cancel()
		return ctx.Err()
	}
	p.mu.Lock()
	if err := p.mu.err; err != nil {
		p.mu.Unlock()
		cancel()
		return err
	}
	p.mu.cancelOut = cancel
	p.mu.Unlock()
	o.stream = cs
	o.watched = make(chan struct{})
	t.wg.Add(1) // Close waits on t.wg only after taking every sem, which the caller holds
	go t.watch(p, cs, f, o.watched)
	return nil
}

// checkAnswer verifies p's answering hello.
func (t *transport) checkAnswer(p *peer, f *inFrame) error {
	defer f.release()
	fail := func(err error) error {
		return &collective.PeerError{Rank: p.rank, Addr: p.addr, Err: err}
	}
	switch {
	case f.err != nil:
		return fail(fmt.Errorf("%w: its answer is not a frame: %w", collective.ErrAuth, f.err))
	case f.hdr.Kind != collective.KindHello:
		return fail(fmt.Errorf("%w: it answered with a frame of kind %d, not a hello", collective.ErrAuth, f.hdr.Kind))
	}
	rank, err := collective.VerifyHello(t.secret, t.job, t.size, f.payload(), time.Now())
	switch {
	case err != nil:
		return fail(fmt.Errorf("its answer: %w", err))
	case rank != p.rank || int(f.hdr.Src) != p.rank:
		return fail(fmt.Errorf("%w: %s answered as rank %d (frame says %d), expected rank %d",
			collective.ErrAuth, p.addr, rank, f.hdr.Src, p.rank))
	}
	return nil
}

// watch reads what the receiving end sends back on an outgoing stream: heartbeats, until the
// stream ends. The end's status says why (a refused frame, the peer closing), and silence
// beyond silenceLimit means the peer is gone even though no connection error arrived:
// gRPC's client keepalive would take ~15 s to notice.
func (t *transport) watch(p *peer, cs grpc.ClientStream, f *inFrame, done chan<- struct{}) {
	defer t.wg.Done()
	defer close(done)
	silent := time.AfterFunc(t.tune.silenceLimit, func() {
		p.fail(t.peerGone(p, fmt.Errorf("no heartbeat for %v", t.tune.silenceLimit)))
	})
	defer silent.Stop()
	for {
		if err := cs.RecvMsg(f); err != nil {
			if !t.isClosed() {
				if errors.Is(err, io.EOF) {
					err = errors.New("it ended the stream")
				}
				p.fail(t.streamError(p, err))
			}
			return
		}
		ok := f.err == nil && f.hdr.Kind == collective.KindHello && f.hdr.Length == 0 && int(f.hdr.Src) == p.rank
		f.release()
		if !ok {
			p.fail(&collective.PeerError{Rank: p.rank, Addr: p.addr, Err: fmt.Errorf(
				"%w: the receiving end sent something other than a heartbeat", collective.ErrProtocol)})
			return
		}
		silent.Reset(t.tune.silenceLimit)
	}
}

// dialer wraps dial so that the link keeps every connection it opens (see cut).
func (o *outLink) dialer(dial func(context.Context, string) (net.Conn, error)) func(context.Context, string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		c, err := dial(ctx, addr)
		if err != nil {
			return nil, err
		}
		c = wrapConn(c)
		o.conns.Lock()
		o.conns.list = append(o.conns.list, c)
		o.conns.Unlock()
		return c, nil
	}
}
