package collective

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// call is the state of one collective on one rank. The Ring keeps finished ones for reuse, so
// a call in steady state allocates only its context.
type call struct {
	r      *Ring
	op     uint8 // OpAllReduce ... OpBarrier
	red    Op
	tag    uint64
	buf    elems  // the caller's buffer; buf.dt is what goes on the wire
	src    elems  // what the sender reads: buf itself, or a shift's send buffer
	shards Shards // the call's partition (the caller's, or evenShards)
	root   int
	ctx    context.Context // ends when the call does: cancels a Send in flight
	cancel context.CancelFunc
	sched  schedule
	total  int // frames to send

	evenShards Shards // scratch for EvenShards of an all-reduce or barrier
	inbox      chan frame
	failc      chan struct{} // signalled when err is set
	// linkc is signalled when the connection from the predecessor broke (Ring.mu.linkErr).
	// Unlike failc it only stops the call once the frames that arrived before the break are
	// used up: a predecessor that finishes the call and closes its transport breaks the link
	// right after sending its last frames, which must still count.
	linkc chan struct{}
	sentc chan struct{} // signalled when the sender has finished a frame of this call
	timer *time.Timer   // the inactivity timeout, reset by every frame

	// held is a frame taken from the inbox while waiting for sends, applied next.
	held    frame
	hasHeld bool
	// aborted: the call failed on an abort from another rank, which has already been
	// forwarded, so this rank must not start another.
	aborted bool
	// heard: a frame from the predecessor has arrived for this call.
	heard bool

	// The sender's position (the sender goroutine's while sending is true).
	sstep, spiece int

	// Guarded by r.mu.
	ready, sent int // send frames ready, and sent
	routed      int // frames handed to inbox (applyDest applies only the next one)
	sending     bool
	ended       bool
	err         error
}

func newCall(r *Ring) *call {
	t := time.NewTimer(time.Hour)
	t.Stop()
	return &call{
		r:          r,
		evenShards: make(Shards, r.size+1),
		inbox:      make(chan frame, recvBuffers),
		failc:      make(chan struct{}, 1),
		linkc:      make(chan struct{}, 1),
		sentc:      make(chan struct{}, 1),
		timer:      t,
	}
}

// start sets c up for one call (under r.mu).
func (c *call) start(ctx context.Context, op uint8, tag uint64, buf, src elems, shards Shards, red Op, root int) {
	r := c.r
	c.op, c.tag, c.buf, c.src, c.red, c.root = op, tag, buf, src, red, root
	c.ctx, c.cancel = context.WithCancel(ctx)
	n := buf.len()
	if op == OpAllReduce || op == OpBarrier {
		shards = evenShardsInto(c.evenShards, n, r.size)
	}
	c.shards = shards
	chunk := r.cfg.ChunkBytes / buf.dt.Bytes()
	if op == OpShift {
		c.sched.planShift(src.len(), n, chunk)
	} else {
		c.sched.plan(op, r.rank, r.size, shards, n, root, chunk)
	}
	c.total = spanFrames(c.sched.send, chunk)
}

// reset clears c for reuse.
func (c *call) reset() {
	if c.cancel != nil {
		c.cancel()
	}
	c.timer.Stop()
	c.buf, c.src, c.shards, c.ctx, c.cancel = elems{}, elems{}, nil, nil, nil
	c.held, c.hasHeld, c.aborted, c.heard = frame{}, false, false, false
	c.sstep, c.spiece = 0, 0
	c.ready, c.sent, c.total, c.routed = 0, 0, 0, 0
	c.sending, c.ended, c.err = false, false, nil
	for _, ch := range []chan struct{}{c.failc, c.linkc, c.sentc} {
		select {
		case <-ch:
		default:
		}
	}
}

func (c *call) name() string { return typedName(c.buf.dt, callName(c.op, c.tag)) }

// failLocked records the first failure and wakes the call (under r.mu).
func (c *call) failLocked(err error) {
	if err == nil || c.err != nil {
		return
	}
	c.err = err
	select {
	case c.failc <- struct{}{}:
	default:
	}
}

// signalLink wakes the call's next() with the broken link (non-blocking).
func (c *call) signalLink() {
	select {
	case c.linkc <- struct{}{}:
	default:
	}
}

func (c *call) fail(err error) {
	c.r.mu.Lock()
	c.failLocked(err)
	c.r.mu.Unlock()
}

// failure returns the recorded failure, naming this call.
func (c *call) failure() error {
	c.r.mu.Lock()
	err := c.err
	c.r.mu.Unlock()
	var pe *PeerError
	if errors.As(err, &pe) && pe.Op == "" {
		return &PeerError{Rank: pe.Rank, Addr: pe.Addr, Op: c.name(), Err: pe.Err}
	}
	if _, ok := err.(*PeerError); ok {
		return err
	}
	return fmt.Errorf("collective %s on rank %d: %w", c.name(), c.r.rank, err)
}

// peerErr is a failure caused by rank.
func (c *call) peerErr(rank int, err error) error {
	return &PeerError{Rank: rank, Addr: c.r.t.Addr(rank), Op: c.name(), Err: err}
}

// localErr is a failure of this rank's own making (context, Close).
// ctxErr is ctx's error together with the cause it was cancelled with, if any (a trainer
// cancels its collectives with "rank 2 failed" when gossip declares a peer dead), so the abort
// this rank sends round the ring names the real culprit, not just "context canceled".
func ctxErr(ctx context.Context) error {
	err := ctx.Err()
	if cause := context.Cause(ctx); cause != nil && cause != err {
		return fmt.Errorf("%w (%w)", err, cause)
	}
	return err
}

func (c *call) localErr(err error) error {
	return fmt.Errorf("collective %s on rank %d: %w", c.name(), c.r.rank, err)
}

// kick tells the sender that pieces may be ready.
func (r *Ring) kick() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// run executes c's schedule: the receive-and-reduce loop in the caller's goroutine, feeding
// the sender piece by piece.
func (c *call) run() error {
	r, s := c.r, &c.sched
	switch {
	case c.op == OpAllGather:
		// Every rank must end with the bits its peers decode, so the owner rounds first.
		c.buf.slice(c.shards[r.rank], c.shards[r.rank+1]).round()
	case c.op == OpBroadcast && r.rank == c.root:
		c.buf.round()
	}
	r.mu.Lock()
	c.ready = s.initial
	r.mu.Unlock()
	r.kick()

	for si, sp := range s.recv {
		if si == s.gateStep {
			if err := c.waitSent(s.gateFrames, true); err != nil {
				return err
			}
		}
		reduce := si < s.reduceSteps
		for p := range pieces(sp.hi-sp.lo, s.chunk) {
			f, err := c.next()
			if err != nil {
				return err
			}
			if f.h.Kind == KindAbort {
				err := c.abortErr(f)
				r.release(f)
				return err
			}
			lo, hi := pieceBounds(sp, p, s.chunk)
			if err := c.check(&f, sp.step, p, lo, hi); err != nil {
				r.release(f)
				return err
			}
			if !f.applied { // else the dispatcher combined it straight from the transport
				c.buf.slice(lo, hi).combine(f.p, reduce, c.red)
			}
			r.release(f)
			if si == s.finalStep {
				c.finalize(c.buf.slice(lo, hi))
			}
			r.mu.Lock()
			c.ready++
			r.mu.Unlock()
			r.kick()
		}
	}
	return c.waitSent(c.total, false)
}

// finalize turns a fully reduced piece into its final value: the average divides by N in
// fp32 (a true division, so integer sums average exactly where they can), and the owner
// rounds to the wire format so that a following all-gather hands every rank the same bits.
// Exact types are final as they are.
func (c *call) finalize(e elems) {
	if !e.dt.float() {
		return
	}
	finalizeFloats(e.f, c.red, c.r.size, e.wire())
}

// finalizeFloats is finalize for a reduced fp32 run among n ranks (the ring's and the
// direct path's).
func finalizeFloats(x []float32, red Op, n int, wire half.Format) {
	if red == Avg {
		if n&(n-1) == 0 {
			vec.Scale(x, 1/float32(n)) // exact: a power of two's reciprocal is exact
		} else {
			n := float32(n)
			for i := range x {
				x[i] /= n
			}
		}
	}
	vec.Round(x, wire)
}

// next returns the next frame for c, waiting at most Config.Timeout for it.
func (c *call) next() (frame, error) {
	if c.hasHeld {
		f := c.held
		c.held, c.hasHeld = frame{}, false
		return f, nil
	}
	// Frames already routed to this call come before any failure: when the predecessor
	// finishes its part and closes its transport, the link breaks right after its last
	// frames, which this call must still consume (and may then complete).
	select {
	case f := <-c.inbox:
		c.heard = true
		return f, nil
	default:
	}
	r := c.r
	// Blame goes to the rank nearest the fault. When the ring stalls, every rank downstream of
	// the stall stops hearing from its predecessor at about the same moment; the one right
	// after it has typically heard nothing at all in this call. A rank that has heard from its
	// predecessor in this call therefore waits a little longer (timeoutSlack) so the abort
	// of the rank that heard nothing, naming the real culprit, reaches it first.
	wait := r.cfg.Timeout
	if c.heard {
		wait += r.cfg.Timeout / timeoutSlack
	}
	c.timer.Reset(wait)
	select {
	case f := <-c.inbox:
		c.heard = true
		return f, nil
	case <-c.failc:
		return frame{}, c.failure()
	case <-c.linkc:
		select {
		case f := <-c.inbox: // routed just before the link broke
			c.signalLink()
			c.heard = true
			return f, nil
		default:
		}
		c.r.mu.Lock()
		err := c.r.mu.linkErr
		if c.r.mu.lateAbort != nil {
			err = c.r.mu.lateAbort // the root cause the departing predecessor reported
		}
		c.r.mu.Unlock()
		c.fail(err)
		return frame{}, c.failure()
	case <-c.timer.C:
		return frame{}, c.timeoutErr(wait)
	case <-c.ctx.Done():
		return frame{}, c.localErr(ctxErr(c.ctx))
	case <-r.done:
		return frame{}, c.localErr(ErrClosed)
	}
}

// timeoutErr is the error for a predecessor silent for wait. If frames from it are queued
// for a call that is not running here, the predecessor has moved on to a call this rank has
// not made — the ranks disagree on tags or on the order of calls — and the error says so
// (wrapping ErrProtocol as well as ErrTimeout): frames keep their order on a connection, so
// a predecessor that had sent this call's frames before the other call's could not leave
// this call waiting.
func (c *call) timeoutErr(wait time.Duration) error {
	r := c.r
	r.mu.Lock()
	var other Header
	queued := len(r.mu.pending)
	if queued > 0 {
		other = r.mu.pending[0].h
	}
	late := r.mu.lateAbort
	r.mu.Unlock()
	if late != nil {
		// The predecessor failed an earlier call that this rank had completed, said why, and
		// has sent nothing since: it stopped on that failure, whose cause is the one to report.
		return late
	}
	if queued == 0 {
		return c.peerErr(r.prev, fmt.Errorf("%w: no frame for %v", ErrTimeout, wait))
	}
	return c.peerErr(r.prev, fmt.Errorf("%w: no frame for %v, while %d frames wait for %s, which is not running on rank %d (%w: do the ranks make the same calls in the same order?)",
		ErrTimeout, wait, queued, callName(other.Op, other.Tag), r.rank, ErrProtocol))
}

// waitSent waits until n of c's frames have been sent, failing if the successor accepts none
// for Config.Timeout. With watch it also takes one frame from the inbox, so that an abort is
// seen at once; a data frame is kept for next.
func (c *call) waitSent(n int, watch bool) error {
	r := c.r
	for {
		r.mu.Lock()
		sent := c.sent
		r.mu.Unlock()
		if sent >= n {
			return nil
		}
		var in chan frame
		if watch && !c.hasHeld {
			in = c.inbox
		}
		c.timer.Reset(r.cfg.Timeout)
		select {
		case <-c.sentc:
		case f := <-in:
			if f.h.Kind == KindAbort {
				err := c.abortErr(f)
				r.release(f)
				return err
			}
			c.held, c.hasHeld, c.heard = f, true, true
		case <-c.failc:
			return c.failure()
		case <-c.timer.C:
			return c.peerErr(r.next, fmt.Errorf("%w: sending stalled for %v", ErrTimeout, r.cfg.Timeout))
		case <-c.ctx.Done():
			return c.localErr(ctxErr(c.ctx))
		case <-r.done:
			return c.localErr(ErrClosed)
		}
	}
}

// check verifies that a data frame is exactly the piece the schedule expects next.
func (c *call) check(f *frame, step uint32, piece, lo, hi int) error {
	h, r := &f.h, c.r
	var why string
	switch {
	case h.Kind != KindData:
		why = fmt.Sprintf("frame kind %d, want data", h.Kind)
	case h.Op != c.op:
		why = fmt.Sprintf("frame of a %s, want %s", opName(h.Op), opName(c.op))
	case h.DType != c.buf.dt:
		why = fmt.Sprintf("element type %v, want %v", h.DType, c.buf.dt)
	case h.Tag != c.tag:
		why = fmt.Sprintf("tag %d, want %d", h.Tag, c.tag)
	case int(h.Src) != r.prev:
		why = fmt.Sprintf("frame from rank %d, want %d", h.Src, r.prev)
	case h.Step != step || h.Piece != uint32(piece):
		why = fmt.Sprintf("step %d piece %d, want step %d piece %d", h.Step, h.Piece, step, piece)
	case h.Offset != uint64(lo) || h.Count != uint32(hi-lo):
		why = fmt.Sprintf("elements [%d, +%d), want [%d, +%d) (do the ranks' lengths or shards differ?)",
			h.Offset, h.Count, lo, hi-lo)
	case uint64(h.Length) != uint64(h.Count)*uint64(c.buf.dt.Bytes()) || !f.applied && len(f.p) != int(h.Length):
		why = fmt.Sprintf("payload of %d bytes (header says %d) for %d %v elements", len(f.p), h.Length, h.Count, c.buf.dt)
	default:
		return nil
	}
	return c.peerErr(r.prev, fmt.Errorf("%w: %s", ErrProtocol, why))
}

// abortErr turns an abort frame into the call's error, naming the rank at fault.
func (c *call) abortErr(f frame) error {
	r := c.r
	fault, origin := int(f.h.Step), int(f.h.Piece)
	if int(f.h.Src) != r.prev || fault >= r.size || origin >= r.size {
		return c.peerErr(r.prev, fmt.Errorf("%w: malformed abort (from %d, fault %d, origin %d)",
			ErrProtocol, f.h.Src, f.h.Step, f.h.Piece))
	}
	c.aborted = true
	reason := strings.ToValidUTF8(string(f.p), "\uFFFD")
	return c.peerErr(fault, fmt.Errorf("%w (rank %d failed: %s)", ErrAborted, origin, reason))
}
