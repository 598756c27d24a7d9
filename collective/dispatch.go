package collective

import (
	"context"
	"errors"
	"fmt"
	"strings"
)

// dispatch is the Ring's only reader of frames from the predecessor. It routes each frame by
// tag to the running call that owns it, queues it for a call that has not started, or drops it
// when it is stale; it forwards aborts at once. When the connection breaks it fails every
// running call, and every later one, and stops.
func (r *Ring) dispatch() {
	defer r.wg.Done()
	for {
		b := r.getBuf()
		if b == nil {
			return // closed
		}
		var h Header
		var p []byte
		var err error
		switch {
		case r.apply != nil:
			r.land.applied = false
			h, p, err = r.apply.RecvApply(r.ctx, r.prev, b, r.applyDest)
			r.endLanding()
		case r.direct != nil:
			h, p, err = r.direct.RecvInto(r.rctx, r.prev, b, r.directFn)
			if r.endDirect() {
				// The frame was being read into a call that has finished since (it failed:
				// a call cannot succeed with a frame of its own still to come). Its data is
				// that call's, so it is dropped, and a read cut short is not a broken link:
				// the transport resumes or skips the rest of the frame (tcpnet, shmnet), and a
				// connection that really broke reports it again on the next read.
				r.putFree(b)
				if r.ctx.Err() != nil {
					return
				}
				if err == nil || errors.Is(err, context.Canceled) {
					continue
				}
				r.breakLink(err)
				return
			}
		default:
			h, p, err = r.t.Recv(r.ctx, r.prev, b)
		}
		if err != nil {
			r.putFree(b)
			if r.ctx.Err() != nil {
				return
			}
			r.breakLink(err)
			return
		}
		if h.Kind == KindAbort {
			r.forwardAbort(h, p)
		}
		r.route(frame{h: h, buf: b, p: p, applied: r.land.applied})
	}
}

// staleAbortErr is the error an abort frame for a finished call stands for.
func (r *Ring) staleAbortErr(f frame) error {
	fault, origin := int(f.h.Step), int(f.h.Piece)
	if int(f.h.Src) != r.prev || fault >= r.size || origin >= r.size {
		return &PeerError{Rank: r.prev, Addr: r.prevAddr, Err: fmt.Errorf("%w: malformed abort (from %d, fault %d, origin %d)",
			ErrProtocol, f.h.Src, f.h.Step, f.h.Piece)}
	}
	reason := strings.ToValidUTF8(string(f.p), "\uFFFD")
	return &PeerError{Rank: fault, Addr: r.t.Addr(fault), Err: fmt.Errorf("%w (rank %d failed an earlier call: %s)", ErrAborted, origin, reason)}
}

// directDest returns where a copy frame's payload belongs — the running call's buffer at the
// exact piece the schedule expects for (step, piece) — so a DirectReceiver reads it there
// without a copy, or nil to receive it into a pool buffer as usual. It only ever names a
// region that nobody else touches until the call applies the frame: a copy step of a started
// call (all-gather, the all-gather half of an all-reduce, broadcast) whose elements' memory
// is their wire encoding (fp32, or an exact type), with the all-reduce's send gate passed
// (the region's reduce-scatter pieces have left). As in
// applyDest, only the frame the call expects next lands there: a later call with the same
// explicit tag must never write into this one's buffer. The read is recorded in r.land, so
// that finish can stop it (unland) before the caller has its buffer back.
func (r *Ring) directDest(h Header) []byte {
	if h.DType != DTypeFP32 && h.DType.float() {
		return nil
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.landingCallLocked(h)
	if c == nil || !c.buf.direct() {
		return nil
	}
	s := &c.sched
	before := 0 // frames of the recv spans before si
	for si, sp := range s.recv {
		if sp.step != h.Step {
			before += pieces(sp.hi-sp.lo, s.chunk)
			continue
		}
		if si < s.reduceSteps || before+int(h.Piece) != c.routed {
			return nil
		}
		if s.gateStep >= 0 && si >= s.gateStep && c.sent < s.gateFrames {
			return nil
		}
		if int(h.Piece) >= pieces(sp.hi-sp.lo, s.chunk) {
			return nil
		}
		lo, hi := pieceBounds(sp, int(h.Piece), s.chunk)
		if h.Offset != uint64(lo) || int(h.Count) != hi-lo || hi > c.buf.len() ||
			uint64(h.Length) != uint64(c.buf.dt.Bytes())*uint64(h.Count) {
			return nil
		}
		r.land.mu.Lock()
		r.land.c, r.land.direct = c, true
		r.land.gen++
		r.land.mu.Unlock()
		return c.buf.slice(lo, hi).mem()
	}
	return nil
}

// landingCallLocked returns the running call a data frame may land in directly, if any: one
// of its op, from the predecessor, that has neither ended nor failed, for a tag whose frames
// route does not drop (under r.mu).
func (r *Ring) landingCallLocked(h Header) *call {
	c := r.mu.active[h.Tag]
	if c == nil || c.ended || c.err != nil || h.DType != c.buf.dt || h.Op != c.op || int(h.Src) != r.prev {
		return nil
	}
	if _, dead := r.mu.dead[h.Tag]; dead && h.Tag < MaxUserTag {
		return nil // stale: route drops it
	}
	return c
}

// endDirect ends the direct read in hand, if any, and reports whether its call finished
// meanwhile (unland cut it: its context is then replaced).
func (r *Ring) endDirect() (cut bool) {
	l := &r.land
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.direct {
		return false
	}
	cut = l.c == nil
	l.c, l.direct = nil, false
	if cut {
		r.rctx, l.cut = context.WithCancel(r.ctx)
	}
	l.idle.Broadcast()
	return cut
}

// unland makes sure nothing writes into c's buffer once it returns (c has ended, so no new
// frame lands there). A frame being applied drops its remaining parts (landPart). A frame
// being read straight into the buffer by a DirectReceiver cannot be stopped part-way, so the
// read's context is cancelled and unland waits for RecvInto to return. That wait is bounded:
// a Transport's Recv returns once its ctx ends, whether the predecessor is alive, dead or
// stalled mid-frame; and it needs neither r.mu nor anything the caller holds.
func (r *Ring) unland(c *call) {
	l := &r.land
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.c != c {
		return
	}
	l.c, l.dst = nil, elems{}
	if !l.direct {
		return
	}
	l.cut()
	for gen := l.gen; l.direct && l.gen == gen; {
		l.idle.Wait()
	}
}

// applyDest returns the function that combines a data frame's payload, part by part, into
// the running call's buffer at the exact piece the schedule expects for (step, piece), for an
// ApplyReceiver to call straight from its memory; nil to receive the frame into a pool
// buffer as usual. Only the frame the call expects next is applied (frames keep their order,
// so anything else is a protocol error, or the next call with the same explicit tag, which
// must not touch this call's buffer), and check still vets it when the call takes it. Reduce
// steps need no gate: the region a reduce-scatter step receives is sent only in the next
// step, after the call has taken this frame; copy steps are gated as in directDest.
func (r *Ring) applyDest(h Header) func(off int, p []byte) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.landingCallLocked(h)
	if c == nil {
		return nil
	}
	s := &c.sched
	before := 0 // frames of the recv spans before si
	for si, sp := range s.recv {
		if sp.step != h.Step {
			before += pieces(sp.hi-sp.lo, s.chunk)
			continue
		}
		if before+int(h.Piece) != c.routed {
			return nil
		}
		if si >= s.reduceSteps && s.gateStep >= 0 && si >= s.gateStep && c.sent < s.gateFrames {
			return nil
		}
		if int(h.Piece) >= pieces(sp.hi-sp.lo, s.chunk) {
			return nil
		}
		lo, hi := pieceBounds(sp, int(h.Piece), s.chunk)
		if h.Offset != uint64(lo) || int(h.Count) != hi-lo || hi > c.buf.len() ||
			uint64(h.Length) != uint64(h.Count)*uint64(c.buf.dt.Bytes()) {
			return nil
		}
		r.land.mu.Lock()
		r.land.c, r.land.dst, r.land.reduce, r.land.red = c, c.buf.slice(lo, hi), si < s.reduceSteps, c.red
		r.land.mu.Unlock()
		r.land.applied = true
		return r.landFn
	}
	return nil
}

// landPart combines one part of the frame being applied into its call's buffer, unless the
// call has finished meanwhile.
func (r *Ring) landPart(off int, p []byte) {
	l := &r.land
	l.mu.Lock()
	if l.c != nil {
		wb := l.dst.dt.Bytes()
		l.dst.slice(off/wb, (off+len(p))/wb).combine(p, l.reduce, l.red)
	}
	l.mu.Unlock()
}

// endLanding forgets the frame applied in place, if any.
func (r *Ring) endLanding() {
	r.land.mu.Lock()
	r.land.c, r.land.dst = nil, elems{}
	r.land.mu.Unlock()
}

// route hands a frame to its call.
func (r *Ring) route(f frame) {
	r.mu.Lock()
	defer r.mu.Unlock()
	tag := f.h.Tag
	if tag >= MaxUserTag && len(r.mu.dead) > 0 {
		// Frames keep their order on a connection: once the predecessor sends for a sequence
		// call issued here after an explicit tag failed, it has nothing left of that failed
		// call to send (the fence of the Ring's doc comment).
		for t, seq := range r.mu.dead {
			if tag-MaxUserTag >= seq {
				delete(r.mu.dead, t)
			}
		}
	}
	if _, dead := r.mu.dead[tag]; dead && tag < MaxUserTag {
		r.release(f)
		return
	}
	if c := r.mu.active[tag]; c != nil {
		// At most recvBuffers frames exist and the inbox holds that many: this never blocks.
		c.inbox <- f
		c.routed++
		return
	}
	if tag >= MaxUserTag && tag-MaxUserTag < r.mu.seq {
		// A sequence call issued here and no longer running: stale. An abort for it means
		// some rank failed a call this rank completed (its predecessor had already sent what
		// it needed). Remember it: if the predecessor then goes away — it is exiting on that
		// failure — later calls report the rank at fault, not the neighbour that left.
		if f.h.Kind == KindAbort {
			r.mu.lateAbort = r.staleAbortErr(f)
		}
		r.release(f)
		return
	}
	r.mu.pending = append(r.mu.pending, f)
}

// breakLink records that the connection from prev is gone and fails the calls.
func (r *Ring) breakLink(err error) {
	var lerr error
	if errors.Is(err, ErrClosed) {
		lerr = fmt.Errorf("receiving from rank %d: %w", r.prev, err)
	} else {
		inner := err
		var pe *PeerError
		if errors.As(err, &pe) {
			inner = pe.Err // the transport already names the peer; do not say it twice
		}
		if !errors.Is(inner, ErrPeerGone) && !errors.Is(inner, ErrProtocol) {
			inner = fmt.Errorf("%w: %w", ErrPeerGone, inner)
		}
		lerr = &PeerError{Rank: r.prev, Addr: r.prevAddr, Err: inner}
	}
	r.mu.Lock()
	r.mu.linkErr = lerr
	for _, c := range r.mu.calls {
		c.signalLink() // fails the call once it has used the frames that arrived before
	}
	r.mu.Unlock()
}

// forwardAbort passes an abort on to the successor unless the successor is where it started.
func (r *Ring) forwardAbort(h Header, p []byte) {
	fault, origin := int(h.Step), int(h.Piece)
	if fault >= r.size || origin >= r.size || origin == r.next || origin == r.rank {
		return
	}
	var a abortMsg
	a.h = h
	a.h.Src = uint16(r.rank)
	a.n = copy(a.reason[:], p)
	a.h.Length = uint32(a.n)
	r.queueAbort(&a)
}

// sendLoop is the Ring's only sender to the successor: aborts first, then the calls' ready
// pieces in turn, each call's in (step, piece) order.
func (r *Ring) sendLoop() {
	defer r.wg.Done()
	for {
		select {
		case <-r.done:
			return
		case a := <-r.ctrl:
			r.sendAbort(&a)
			continue
		default:
		}
		r.mu.Lock()
		c := r.pickLocked()
		r.mu.Unlock()
		if c == nil {
			select {
			case <-r.wake:
			case a := <-r.ctrl:
				r.sendAbort(&a)
			case <-r.done:
				return
			}
			continue
		}
		err := r.sendPiece(c)
		r.mu.Lock()
		c.sending = false
		if err == nil {
			c.sent++
		} else if c.ctx.Err() == nil {
			// A cancelled context means the call is ending, and reports its own error.
			inner := err
			var pe *PeerError
			if errors.As(err, &pe) {
				inner = pe.Err
			}
			c.failLocked(&PeerError{Rank: r.next, Addr: r.nextAddr, Op: c.name(), Err: inner})
		}
		r.mu.Unlock()
		select {
		case c.sentc <- struct{}{}:
		default:
		}
	}
}

// pickLocked chooses the next call with a piece ready, round robin, and marks it sending.
func (r *Ring) pickLocked() *call {
	n := len(r.mu.calls)
	for i := range n {
		j := (r.mu.rr + i) % n
		c := r.mu.calls[j]
		if !c.ended && c.err == nil && c.sent < c.ready && c.sent < c.total && c.ctx.Err() == nil {
			c.sending = true
			r.mu.rr = j + 1
			return c
		}
	}
	return nil
}

// sendPiece sends c's next piece and advances its cursor.
func (r *Ring) sendPiece(c *call) error {
	sp := c.sched.send[c.sstep]
	lo, hi := pieceBounds(sp, c.spiece, c.sched.chunk)
	var words []uint16
	if !c.src.direct() {
		if r.words == nil {
			r.words = make([]uint16, r.cfg.ChunkBytes/2)
			r.sendBytes.Store(int64(2 * len(r.words)))
		}
		words = r.words
	}
	payload := c.src.slice(lo, hi).payload(words)
	h := Header{
		Kind: KindData, DType: c.src.dt, Op: c.op, Src: uint16(r.rank), Tag: c.tag,
		Step: sp.step, Piece: uint32(c.spiece), Offset: uint64(lo), Count: uint32(hi - lo),
		Length: uint32(len(payload)),
	}
	if err := r.t.Send(c.ctx, r.next, h, payload); err != nil {
		return err
	}
	if c.spiece++; c.spiece == pieces(sp.hi-sp.lo, c.sched.chunk) {
		c.sstep, c.spiece = c.sstep+1, 0
	}
	return nil
}

// sendAbort sends one abort, giving up after Config.Timeout: aborts are best effort.
func (r *Ring) sendAbort(a *abortMsg) {
	defer r.aborts.Add(-1)
	ctx, cancel := context.WithTimeout(r.ctx, r.cfg.Timeout)
	defer cancel()
	_ = r.t.Send(ctx, r.next, a.h, a.reason[:a.n])
}
