package grpcnet

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	grpcpeer "google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/lograte"
)

// The hand-written service: no .proto exists because the only message is a raw frame
// (frameCodec). Equivalent to
//
//	service Frames { rpc Stream(stream Frame) returns (stream Frame); }
const (
	serviceName = "qvd.collective.v1.Frames"
	streamName  = "Stream"
	fullMethod  = "/" + serviceName + "/" + streamName
	// jobKey carries the job a stream claims; its hello must verify with that job's secret.
	// A -bin key, so any job id is legal metadata.
	jobKey = "qvd-job-bin"
)

// framesServer is the handler type gRPC checks the Hub against at registration.
type framesServer interface {
	serveStream(grpc.ServerStream) error
}

var framesDesc = grpc.ServiceDesc{
	ServiceName: serviceName,
	HandlerType: (*framesServer)(nil),
	Streams: []grpc.StreamDesc{{
		StreamName:    streamName,
		Handler:       func(srv any, ss grpc.ServerStream) error { return srv.(framesServer).serveStream(ss) },
		ServerStreams: true,
		ClientStreams: true,
	}},
	Metadata: "collective/grpcnet (hand-written, no .proto)",
}

// Refused-stream warnings are bounded: behind the cluster's ServerOptions only key holders
// reach the Hub, but a Hub served without them could be made to log a line per stream.
const (
	refusalBurst = 10
	refusalEvery = 10 * time.Second
)

// Hub accepts the frame streams that arrive at this process's gRPC server and hands each to
// the transport of the job it claims, once its hello proves it belongs there.
type Hub struct {
	log    *zap.Logger
	lim    *lograte.Limiter // bounds the refused-stream warnings
	tune   tuning
	closed chan struct{}
	wg     sync.WaitGroup // stream readers

	jobs collective.Jobs[*transport] // the transports made here, by job

	mu struct {
		sync.Mutex
		closed bool
	}
}

// NewHub registers the frame service on server, which must not be serving yet and should be
// built with ServerOptions. log may be nil.
func NewHub(server grpc.ServiceRegistrar, log *zap.Logger) *Hub {
	if log == nil {
		log = zap.NewNop()
	}
	h := &Hub{log: log, lim: lograte.New(refusalBurst, refusalEvery), tune: defaultTuning, closed: make(chan struct{})}
	server.RegisterService(&framesDesc, h)
	return h
}

// Close closes every transport made by the Hub and refuses streams from now on. The gRPC
// server stays the caller's. Safe to call twice.
func (h *Hub) Close() error {
	h.mu.Lock()
	if h.mu.closed {
		h.mu.Unlock()
		h.wg.Wait()
		return nil
	}
	h.mu.closed = true
	close(h.closed)
	h.mu.Unlock()
	for _, t := range h.jobs.Close() {
		_ = t.Close()
	}
	h.wg.Wait()
	return nil
}

// Transport creates this process's transport for g and registers it on the Hub, so that
// streams claiming g.Job are routed to it. One transport per job per Hub. Streams to peers
// are opened lazily by the first Send to each (bounded by that Send's ctx); ctx only bounds
// this call.
func (h *Hub) Transport(ctx context.Context, g Group) (collective.Transport, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("grpcnet: transport for job %q: %w", g.Job, err)
	}
	if err := g.Roster.Validate(); err != nil {
		return nil, fmt.Errorf("grpcnet: transport for job %q: %w", g.Job, err)
	}
	t := newTransport(h, g)
	// Registering wakes the streams that arrived before this job did.
	if err := h.jobs.Register(g.Job, t); err != nil {
		return nil, fmt.Errorf("grpcnet: transport for job %q on this hub: %w", g.Job, err)
	}
	return t, nil
}

func (h *Hub) unregister(t *transport) { h.jobs.Unregister(t.job, t) }

// lookup returns the transport of job, waiting until deadline fires for it to register.
func (h *Hub) lookup(job string, deadline <-chan time.Time) (*transport, error) {
	for {
		t, ok, closed, changed := h.jobs.Get(job)
		select {
		case <-h.closed: // the Hub closes before its registry does
			closed = true
		default:
		}
		switch {
		case closed:
			return nil, status.Error(codes.Unavailable, "grpcnet: hub closed")
		case ok:
			return t, nil
		}
		select {
		case <-changed:
		case <-deadline:
			return nil, status.Errorf(codes.NotFound, "grpcnet: job %q is not running here", job)
		case <-h.closed:
		}
	}
}

// inStream is one incoming stream: the gRPC handler goroutine supervises it (handshake,
// heartbeats, ending it) while a reader goroutine, owned by the Hub, receives its messages.
// The reader is separate because RecvMsg cannot be interrupted except by the handler
// returning, which ends the stream.
type inStream struct {
	ss     grpc.ServerStream
	first  chan *inFrame // the opening message
	attach chan *peer    // where the reader delivers frames, once the hello verified
	done   chan struct{} // closed when the reader has stopped
	err    error         // why the reader stopped, before the stream was attached
}

func (h *Hub) serveStream(ss grpc.ServerStream) error {
	ctx := ss.Context()
	remote := "unknown"
	if p, ok := grpcpeer.FromContext(ctx); ok && p.Addr != nil {
		remote = p.Addr.String()
	}
	var job string
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get(jobKey); len(v) == 1 {
			job = v[0]
		}
	}
	refuse := func(err error) error {
		if ok, suppressed := h.lim.Allow(); ok {
			h.log.Warn("grpcnet: refused a frame stream", zap.String("remote", remote), zap.String("job", job), zap.Error(err),
				lograte.Field(suppressed))
		}
		return err
	}
	if job == "" {
		return refuse(status.Error(codes.Unauthenticated, "grpcnet: the stream claims no job"))
	}

	r := &inStream{ss: ss, first: make(chan *inFrame, 1), attach: make(chan *peer, 1), done: make(chan struct{})}
	h.mu.Lock()
	if h.mu.closed {
		h.mu.Unlock()
		return status.Error(codes.Unavailable, "grpcnet: hub closed")
	}
	h.wg.Add(1)
	h.mu.Unlock()
	go h.read(r)
	// The reader waits for exactly one value on r.attach: the peer to deliver to, or nil
	// when the stream is refused.
	handedOver := false
	defer func() {
		if !handedOver {
			r.attach <- nil
		}
	}()

	timer := time.NewTimer(h.tune.handshake)
	defer timer.Stop()
	var f *inFrame
	select {
	case f = <-r.first:
	case <-r.done:
		return refuse(status.Errorf(codes.Unauthenticated, "grpcnet: the stream ended before its hello: %v", r.err))
	case <-timer.C:
		return refuse(status.Errorf(codes.Unauthenticated, "grpcnet: no hello within %v", h.tune.handshake))
	case <-h.closed:
		return status.Error(codes.Unavailable, "grpcnet: hub closed")
	}
	if f.err != nil {
		return refuse(status.Errorf(codes.Unauthenticated, "grpcnet: the stream must open with a hello: %v", f.err))
	}
	if f.hdr.Kind != collective.KindHello {
		f.release()
		return refuse(status.Errorf(codes.Unauthenticated, "grpcnet: the stream opened with a frame of kind %d, not a hello", f.hdr.Kind))
	}
	hello, src := f.payload(), int(f.hdr.Src)
	f.release()

	t, err := h.lookup(job, timer.C)
	if err != nil {
		return refuse(err)
	}
	rank, err := collective.VerifyHello(t.secret, t.job, t.size, hello, time.Now())
	switch {
	case err != nil:
		// The code says it is an authentication failure; the text says which.
		return refuse(status.Error(codes.Unauthenticated, "grpcnet: hello refused: "+
			strings.TrimPrefix(err.Error(), collective.ErrAuth.Error()+": ")))
	case rank != src:
		return refuse(status.Errorf(codes.Unauthenticated, "grpcnet: hello of rank %d in a frame from rank %d", rank, src))
	case rank == t.rank:
		return refuse(status.Errorf(codes.Unauthenticated, "grpcnet: a stream claiming this process's own rank %d", rank))
	}
	p := t.peers[rank]
	if err := t.attach(p); err != nil {
		return refuse(err)
	}
	// Answer with our own hello: the sender learns the stream was accepted (and commits it,
	// see DialOptions) and that it reached the rank it meant to.
	if err := ss.SendMsg(newRawFrame(collective.Header{Kind: collective.KindHello, Src: uint16(t.rank)},
		collective.NewHello(t.secret, t.job, t.rank, t.size, time.Now()))); err != nil {
		p.fail(t.peerGone(p, fmt.Errorf("answering its hello: %w", err)))
	}
	r.attach <- p
	handedOver = true
	h.log.Debug("grpcnet: accepted a frame stream", zap.String("remote", remote), zap.String("job", job), zap.Int("rank", rank))

	beat := time.NewTicker(t.tune.heartbeatEvery)
	defer beat.Stop()
	for {
		select {
		case <-beat.C:
			// A failed send means the stream broke; the reader reports why.
			_ = ss.SendMsg(&rawFrame{b: t.beat})
		case <-r.done:
			return nil
		case <-p.gone:
			err := p.failure()
			code := codes.Unavailable
			if errors.Is(err, collective.ErrProtocol) {
				code = codes.InvalidArgument
			}
			return status.Errorf(code, "grpcnet: rank %d dropped the link: %v", t.rank, err)
		case <-t.closed:
			return status.Errorf(codes.Unavailable, "grpcnet: rank %d closed its transport for job %q", t.rank, t.job)
		case <-h.closed:
			return status.Error(codes.Unavailable, "grpcnet: hub closed")
		}
	}
}

// read receives a stream's messages: the hello for the handler, then frames into the
// attached peer's queue, until the stream ends.
func (h *Hub) read(r *inStream) {
	defer h.wg.Done()
	defer close(r.done)
	ctx := r.ss.Context()
	f := new(inFrame)
	if err := r.ss.RecvMsg(f); err != nil {
		r.err = err
		return
	}
	r.first <- f
	p := <-r.attach
	if p == nil { // refused
		return
	}
	t, in := p.t, &p.in
	defer t.wg.Done() // added by attach
	for {
		for in.queued.Load() > inQueueBytes {
			select {
			case <-in.taken:
			case <-ctx.Done():
				t.streamEnded(p, ctx.Err())
				return
			case <-p.gone:
				return
			case <-t.closed:
				return
			}
		}
		select {
		case f = <-in.free:
		case <-ctx.Done():
			t.streamEnded(p, ctx.Err())
			return
		case <-p.gone:
			return
		case <-t.closed:
			return
		}
		if err := r.ss.RecvMsg(f); err != nil {
			in.free <- f
			t.streamEnded(p, err)
			return
		}
		if f.err == nil {
			switch {
			case f.hdr.Kind == collective.KindHello:
				f.err = fmt.Errorf("%w: a hello frame after the handshake", collective.ErrProtocol)
			case int(f.hdr.Src) != p.rank:
				f.err = fmt.Errorf("%w: a frame claiming rank %d on the stream of rank %d", collective.ErrProtocol, f.hdr.Src, p.rank)
			}
		}
		if f.err != nil {
			f.release()
			in.free <- f
			p.fail(&collective.PeerError{Rank: p.rank, Addr: p.addr, Err: f.err})
			return
		}
		in.queued.Add(int64(f.hdr.Length))
		select {
		case in.frames <- f:
		case <-ctx.Done():
			f.release()
			in.free <- f
			t.streamEnded(p, ctx.Err())
			return
		case <-p.gone:
			f.release()
			in.free <- f
			return
		case <-t.closed:
			f.release()
			in.free <- f
			return
		}
	}
}
