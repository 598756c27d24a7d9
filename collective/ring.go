package collective

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/qvd/qvd/internal/half"
)

// Ring is the Communicator that runs the ring algorithms (schedule.go) over any Transport.
// Rank r only ever sends to (r+1) mod N and receives from (r-1) mod N.
//
// Goroutines. A Ring owns two: the dispatcher, the only caller of Transport.Recv from the
// predecessor, which routes every frame by tag to the call waiting for it; and the sender,
// the only goroutine that sends to the successor, which takes ready pieces from the active
// calls in turn (round robin) and aborts ahead of them. A call runs its receive-and-reduce
// loop in the caller's goroutine and tells the sender, piece by piece, what may go out, so
// sending, receiving and reducing overlap (the pipelining of Patarasuk & Yuan and NCCL).
// Close stops both goroutines and waits for them.
//
// Flow control. Frames are received into a pool of Config.ChunkBytes buffers, at most
// recvBuffersFor(ChunkBytes) of them. Frames for a call that has not started on this rank yet (its tag is not
// registered) are queued, holding their buffers, until it starts; when every buffer is held
// the dispatcher stops reading from the predecessor, which in turn stalls its sends — the
// same back-pressure a TCP window gives — rather than buffering without bound. A call whose
// frames are stuck behind a full queue then fails by timeout, never hangs.
//
// Tags. Call.Tag 0 takes the next value of the Ring's sequence (MaxUserTag + n), which is
// right when every rank makes the same calls in the same order. Frames for a sequence tag
// already issued and finished are stale (left over from a failed call) and are dropped.
// Explicit tags must be below MaxUserTag and distinct among concurrent calls on a rank; a
// tag may be reused once the call that used it has returned on every rank (a Barrier is one
// way to know). After a call with an explicit tag fails on a rank, frames for that tag from
// the predecessor are dropped — left over from the failed call, they must not be mistaken
// for a later call's — until the predecessor's frames show that it has gone on to a sequence
// call issued after the failure. So an explicit tag whose call failed may be used again once
// the ranks have completed a Barrier (or any untagged call) after the failure; used before,
// the new call fails rather than risk taking stale data.
//
// Every rank must use the same Config.ChunkBytes: it sets the pieces, which the receiver
// checks frame by frame, and the receive buffers (a larger frame breaks the connection).
// A Ring is the only reader of its Transport's frames from the predecessor: do not put two
// Rings on one Transport. All methods are safe for concurrent use.
type Ring struct {
	t                  Transport
	cfg                Config
	rank, size         int
	prev, next         int
	prevAddr, nextAddr string
	bufSize            int   // bytes of one receive buffer
	maxBufs            int64 // receive buffers the pool may hold (recvBuffersFor)

	ctx    context.Context // the Ring's lifetime: Recv and abort sends
	cancel context.CancelFunc
	done   chan struct{}
	once   sync.Once
	wg     sync.WaitGroup

	// free holds idle receive buffers as a stack: the buffer released last is reused first,
	// while it is still in cache. A FIFO would cycle through all of them (4 MiB at the
	// default piece size), so every received piece would land in memory no core had touched
	// recently. freed wakes a dispatcher waiting for a buffer.
	freeMu    sync.Mutex
	free      [][]byte
	freed     chan struct{}
	nbufs     atomic.Int64
	sendBytes atomic.Int64

	ctrl chan abortMsg // aborts for the sender to send, ahead of data
	// direct is t as a DirectReceiver, if it is one (copy frames then land in place).
	direct DirectReceiver
	// apply is t as an ApplyReceiver, if it is one: then frames of both halves are reduced
	// or copied into the call's buffer straight from the transport's memory (applyDest),
	// and direct is not used.
	apply ApplyReceiver
	// land is the frame the dispatcher is applying, or reading straight into a call's buffer,
	// if any. Its mutex is held while a part is applied, so finish, by clearing c under it,
	// knows that nothing writes into the call's buffer after it returns, even if the frame is
	// still arriving (the caller owns its buffer again once the call returns). A direct read
	// cannot be stopped between parts, so finish cuts it short (land.cut) and waits for
	// RecvInto to return (see unland). landFn is landPart and directFn directDest, bound once.
	land     landing
	landFn   func(off int, p []byte)
	directFn func(Header) []byte
	// rctx is the context of the dispatcher's RecvInto: a child of ctx that finish cancels
	// (land.cut) to stop a read into its call's buffer, and the dispatcher then replaces.
	// Dispatcher only; land.cut is its cancel.
	rctx context.Context
	// aborts counts aborts queued but not yet handed to the transport; Close waits for them
	// (briefly), so a rank that fails and exits still tells its successor why.
	aborts atomic.Int32
	wake   chan struct{} // a call has pieces ready to send

	words []uint16 // the sender's encode buffer for 16-bit wires (sender goroutine only)

	// shared is t's SharedMemory extension, if it has one (found through Count's wrapper):
	// float calls on buffers in its arena take the direct path (direct.go). counts is t's
	// WireCounts, if t counts, to which the direct path adds what it reads and is read.
	shared SharedMemory
	counts *WireCounts
	dir    directState

	mu struct {
		sync.Mutex
		closed  bool
		seq     uint64            // sequence tags issued
		active  map[uint64]*call  // running calls by tag
		calls   []*call           // running calls in start order, for the sender's round robin
		rr      int               // where the sender's round robin resumes
		pending []frame           // frames for calls that have not started on this rank
		dead    map[uint64]uint64 // explicit tags whose call failed here → the sequence then
		linkErr error             // sticky: the connection from prev broke
		// lateAbort: an abort that arrived for a call this rank had completed (see route).
		lateAbort error
		idle      []*call // call states kept for reuse
	}
}

var _ Communicator = (*Ring)(nil)

const (
	// recvBuffers bounds the frames a Ring holds: received and not yet applied, or queued for
	// calls that have not started. Within it the pool is held to recvBytes (8 pieces at the
	// default 512 KiB), but never fewer than minRecvBuffers: that keeps the pipe full with a
	// few concurrent calls and bounds memory per Ring. 8 MiB of pieces, with the Go heap's
	// headroom on them, was 10 MiB of every rank's RSS; halving it left the 36.8M MLP's step
	// within the noise (docs/memory.md).
	recvBuffers    = 16
	recvBytes      = 4 << 20
	minRecvBuffers = 4
	// ctrlQueue bounds the aborts waiting to be sent. Aborts are an optimisation over the
	// timeout, so one that does not fit is dropped rather than block the dispatcher.
	ctrlQueue = 32
	// abortReasonMax bounds an abort's reason text, so it always fits a receive buffer.
	abortReasonMax = 512
	// timeoutSlack: a rank that has heard from its predecessor in a call waits
	// Timeout + Timeout/timeoutSlack before blaming it (see call.next).
	timeoutSlack = 4
	// maxRanks is the largest group a frame's 16-bit Src field can name.
	maxRanks = 1 << 16
)

// frame is a received frame: its header, the pooled buffer it was read into, and its payload
// (a prefix of buf, or wherever the transport put it within buf). applied: the payload was
// already combined into the call's buffer by the dispatcher (ApplyReceiver) and p is nil.
type frame struct {
	h       Header
	buf     []byte
	p       []byte
	applied bool
}

// landing is the state of the frame the dispatcher applies in place, or reads straight into
// a call's buffer (see Ring.land).
type landing struct {
	mu      sync.Mutex
	c       *call // nil: no frame, or its call has finished and the rest must be dropped
	dst     elems
	reduce  bool
	red     Op
	applied bool // the frame in hand was given to landPart (dispatcher only)

	// direct: a RecvInto that directDest gave c's buffer has not returned yet. gen counts
	// the direct reads, so unland waits for the one it cut and not a later one; idle is
	// signalled (on mu) when one returns; cut cancels Ring.rctx.
	direct bool
	gen    uint64
	idle   sync.Cond
	cut    context.CancelFunc
}

// abortMsg is an abort frame waiting to be sent. For KindAbort frames Header.Step carries the
// rank at fault and Header.Piece the rank whose call failed first (the origin), so the abort
// can stop one hop before it returns to the origin; the payload is the reason in UTF-8.
// abortFlush bounds how long Close waits for queued aborts to be sent.
const abortFlush = 2 * time.Second

type abortMsg struct {
	h      Header
	n      int
	reason [abortReasonMax]byte
}

// NewRing returns a Ring over t, which must already be connected to the group, and starts its
// dispatcher and sender (none for a group of one). The Ring does not own t: Close leaves it
// open.
func NewRing(t Transport, cfg Config) (*Ring, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("collective: ring config: %w", err)
	}
	if !hostLittleEndian {
		return nil, errors.New("collective: the ring sends host memory as little-endian frames and does not run on a big-endian host")
	}
	size, rank := t.Size(), t.Rank()
	if size < 1 || size > maxRanks {
		return nil, fmt.Errorf("collective: group of %d ranks, want 1 to %d", size, maxRanks)
	}
	if rank < 0 || rank >= size {
		return nil, fmt.Errorf("collective: rank %d outside a group of %d", rank, size)
	}
	r := &Ring{
		t: t, cfg: cfg, rank: rank, size: size,
		prev: mod(rank-1, size), next: mod(rank+1, size),
		bufSize: cfg.ChunkBytes, maxBufs: recvBuffersFor(cfg.ChunkBytes),
		done:  make(chan struct{}),
		free:  make([][]byte, 0, recvBuffers),
		freed: make(chan struct{}, 1),
		ctrl:  make(chan abortMsg, ctrlQueue),
		wake:  make(chan struct{}, 1),
	}
	r.prevAddr, r.nextAddr = t.Addr(r.prev), t.Addr(r.next)
	r.direct, _ = t.(DirectReceiver)
	r.apply, _ = t.(ApplyReceiver)
	r.shared = sharedOf(t)
	if ct, ok := t.(CountingTransport); ok {
		r.counts = ct.WireCounts()
	}
	r.landFn, r.directFn = r.landPart, r.directDest
	r.land.idle.L = &r.land.mu
	r.ctx, r.cancel = context.WithCancel(context.Background())
	r.rctx, r.land.cut = context.WithCancel(r.ctx)
	r.mu.active = make(map[uint64]*call)
	r.mu.dead = make(map[uint64]uint64)
	r.mu.pending = make([]frame, 0, recvBuffers)
	if size > 1 {
		r.wg.Add(2)
		go r.dispatch()
		go r.sendLoop()
	}
	return r, nil
}

// recvBuffersFor is the size of the receive pool for pieces of chunk bytes: recvBytes of
// them, at least minRecvBuffers and at most recvBuffers.
func recvBuffersFor(chunk int) int64 {
	return int64(min(max(recvBytes/max(chunk, 1), minRecvBuffers), recvBuffers))
}

// Rank is this rank's index in the group.
func (r *Ring) Rank() int { return r.rank }

// Size is the number of ranks in the group.
func (r *Ring) Size() int { return r.size }

// BufferBytes reports the bytes of receive and send buffers the Ring holds in its pools, for
// memory accounting. It grows to at most recvBuffersFor(ChunkBytes) pieces plus one encode
// buffer once a 16-bit wire has been used.
func (r *Ring) BufferBytes() int64 {
	return r.nbufs.Load()*int64(r.bufSize) + r.sendBytes.Load()
}

// Close stops the Ring's goroutines and fails its running calls with ErrClosed. It does not
// close the Transport. Safe to call more than once.
func (r *Ring) Close() error {
	r.once.Do(func() {
		// A rank whose last call failed has queued an abort naming the culprit; let it reach
		// the successor before this rank goes, or the successor would only see this rank
		// vanish and blame it instead.
		for deadline := time.Now().Add(min(r.cfg.Timeout, abortFlush)); r.aborts.Load() > 0 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
		r.mu.Lock()
		r.mu.closed = true
		r.mu.Unlock()
		close(r.done)
		r.cancel()
		r.wg.Wait()
	})
	return nil
}

// AllReduce reduces buf across the ranks in place: a ring reduce-scatter over EvenShards of
// the buffer followed by a ring all-gather, under one tag, with continuous step numbers.
func (r *Ring) AllReduce(ctx context.Context, buf []float32, op Op, c Call) error {
	return r.run(ctx, OpAllReduce, floatElems(buf, c.Wire), nil, op, 0, c)
}

// ReduceScatter leaves the reduction of shard r in buf[shards[r]:shards[r+1]] on rank r,
// rounded to the wire format (so a following AllGather spreads identical bits). The rest of
// buf holds partial sums.
func (r *Ring) ReduceScatter(ctx context.Context, buf []float32, shards Shards, op Op, c Call) error {
	return r.run(ctx, OpReduceScatter, floatElems(buf, c.Wire), shards, op, 0, c)
}

// AllGather fills buf on every rank with every rank's shard. With a 16-bit wire each rank
// first rounds its own shard in place, so every rank ends bit-identical.
func (r *Ring) AllGather(ctx context.Context, buf []float32, shards Shards, c Call) error {
	return r.run(ctx, OpAllGather, floatElems(buf, c.Wire), shards, Sum, 0, c)
}

// Broadcast copies root's buf to every rank along the pipelined chain root → root+1 → ...
// With a 16-bit wire root first rounds its buffer in place.
func (r *Ring) Broadcast(ctx context.Context, buf []float32, root int, c Call) error {
	return r.run(ctx, OpBroadcast, floatElems(buf, c.Wire), nil, Sum, root, c)
}

// AllReduceInt64 is AllReduce on int64 elements, exact: the same ring schedule and frames,
// with int64 payloads (DTypeInt64) reduced as integers. Its tag is the next of the sequence.
func (r *Ring) AllReduceInt64(ctx context.Context, v []int64, op Op) error {
	return r.run(ctx, OpAllReduce, elems{i: v, dt: DTypeInt64}, nil, op, 0, Call{})
}

// BroadcastBytes is Broadcast on raw bytes (DTypeUint8 frames), along the same chain. Its
// tag is the next of the sequence.
func (r *Ring) BroadcastBytes(ctx context.Context, b []byte, root int) error {
	return r.run(ctx, OpBroadcast, elems{b: b, dt: DTypeUint8}, nil, Sum, root, Call{})
}

// Barrier returns once every rank has entered it. It is a reduce-scatter of nothing: one
// empty frame per step. Rank r's last frame was forwarded by r-1 after its previous one,
// and so on back to r+1's first frame, so its arrival proves that every other rank has
// entered (each sends only after entering).
func (r *Ring) Barrier(ctx context.Context) error {
	return r.run(ctx, OpBarrier, elems{}, nil, Sum, 0, Call{})
}

// opName names a collective for error messages.
func opName(op uint8) string {
	switch op {
	case OpAllReduce:
		return "all-reduce"
	case OpReduceScatter:
		return "reduce-scatter"
	case OpAllGather:
		return "all-gather"
	case OpBroadcast:
		return "broadcast"
	case OpBarrier:
		return "barrier"
	case OpShift:
		return "shift"
	}
	return fmt.Sprintf("op %d", op)
}

// callName names one call for errors: "all-reduce (tag 7)", or "(auto tag 12)" for the
// sequence.
func callName(op uint8, tag uint64) string {
	if tag >= MaxUserTag {
		return fmt.Sprintf("%s (auto tag %d)", opName(op), tag-MaxUserTag)
	}
	return fmt.Sprintf("%s (tag %d)", opName(op), tag)
}

// ValidateCall checks the arguments of a call of collective op (OpAllReduce ... OpBarrier)
// on a buffer of n elements in a group of size ranks, as the Ring does. Every error is the
// caller's. Other Communicators (the NCCL one) use it so that all of them refuse the same
// calls with the same messages.
func ValidateCall(op uint8, n, size int, shards Shards, red Op, root int, c Call) error {
	if c.Tag >= MaxUserTag {
		return fmt.Errorf("tag %d: explicit tags must be below MaxUserTag", c.Tag)
	}
	switch c.Wire {
	case half.FP32, half.FP16, half.BF16:
	default:
		return fmt.Errorf("wire type %v: want fp32, fp16 or bf16", c.Wire)
	}
	switch op {
	case OpAllReduce, OpReduceScatter:
		if red != Sum && red != Avg && red != Max && red != Min {
			return fmt.Errorf("unknown reduction %v", red)
		}
	case OpBroadcast:
		if root < 0 || root >= size {
			return fmt.Errorf("broadcast root %d outside a group of %d", root, size)
		}
	case OpAllGather, OpBarrier, OpShift:
	default:
		return fmt.Errorf("unknown collective %d", op)
	}
	if op == OpReduceScatter || op == OpAllGather {
		if err := shards.Validate(n, size); err != nil {
			return err
		}
	}
	return nil
}

// ValidateInt64 checks the reduction of an AllReduceInt64 as the Ring does: Sum, Max or
// Min (an average has no exact int64 result). Other Communicators use it so that all of them
// refuse the same calls with the same messages.
func ValidateInt64(op Op) error {
	switch op {
	case Sum, Max, Min:
		return nil
	}
	return fmt.Errorf("reduction %v on int64: want sum, max or min", op)
}

// validateElems is ValidateCall for a call on buf, which may be of an exact type.
func validateElems(op uint8, buf elems, size int, shards Shards, red Op, root int, cl Call) error {
	if buf.dt == DTypeInt64 {
		if err := ValidateInt64(red); err != nil {
			return err
		}
	}
	return ValidateCall(op, buf.len(), size, shards, red, root, cl)
}

// typedName prefixes the name of a call on an exact type with the type ("int64 all-reduce
// (auto tag 3)").
func typedName(dt DType, name string) string {
	switch dt {
	case DTypeInt64:
		return "int64 " + name
	case DTypeUint8:
		return "byte " + name
	}
	return name
}

// run is every collective: validate, take a tag, register, run the schedule, clean up.
// For a barrier buf is empty (its type is fp32).
func (r *Ring) run(ctx context.Context, op uint8, buf elems, shards Shards, red Op, root int, cl Call) error {
	return r.runFrom(ctx, op, buf, buf, shards, red, root, cl)
}

// runFrom is run with the sender reading src: buf itself, except for a shift.
func (r *Ring) runFrom(ctx context.Context, op uint8, buf, src elems, shards Shards, red Op, root int, cl Call) error {
	verr := validateElems(op, buf, r.size, shards, red, root, cl)
	if r.size == 1 && verr == nil {
		// A group of one: nothing to exchange, and the data is left untouched (the average
		// or maximum of one rank is its own value).
		if r.isClosed() {
			return fmt.Errorf("collective %s: %w", opName(op), ErrClosed)
		}
		return ctx.Err()
	}

	c := r.getCall()
	r.mu.Lock()
	if r.mu.closed {
		r.mu.Unlock()
		r.putCall(c)
		return fmt.Errorf("collective %s: %w", opName(op), ErrClosed)
	}
	tag := cl.Tag
	if tag == 0 {
		// The sequence advances even for a call that fails validation, so the ranks' sequences
		// stay aligned and the abort below reaches the matching call on the other ranks.
		tag = MaxUserTag + r.mu.seq
		r.mu.seq++
	}
	if verr != nil {
		r.mu.Unlock()
		r.putCall(c)
		if cl.Tag >= MaxUserTag {
			return fmt.Errorf("collective %s on rank %d: %w", typedName(buf.dt, opName(op)), r.rank, verr)
		}
		err := fmt.Errorf("collective %s on rank %d: %w", typedName(buf.dt, callName(op, tag)), r.rank, verr)
		r.originateAbort(op, tag, r.rank, err)
		return err
	}
	if r.shared != nil && op != OpBarrier && op != OpShift && buf.dt.float() {
		if off, ok := r.shared.SharedOffset(buf.f); ok {
			r.mu.Unlock()
			r.putCall(c)
			return r.runDirect(ctx, op, buf, shards, red, root, tag, off)
		}
	}
	if r.mu.active[tag] != nil {
		r.mu.Unlock()
		r.putCall(c)
		return fmt.Errorf("collective %s on rank %d: tag %d is already used by a running call", callName(op, tag), r.rank, tag)
	}
	c.start(ctx, op, tag, buf, src, shards, red, root)
	r.mu.active[tag] = c
	r.mu.calls = append(r.mu.calls, c)
	// Hand over the frames that arrived before this call started, in arrival order.
	kept := r.mu.pending[:0]
	for _, f := range r.mu.pending {
		if f.h.Tag == tag {
			c.inbox <- f
			c.routed++
		} else {
			kept = append(kept, f)
		}
	}
	clear(r.mu.pending[len(kept):])
	r.mu.pending = kept
	if r.mu.linkErr != nil {
		c.signalLink()
	}
	r.mu.Unlock()

	err := c.run()
	return r.finish(c, err)
}

func (r *Ring) isClosed() bool {
	select {
	case <-r.done:
		return true
	default:
		return false
	}
}

// finish ends call c with result err: it stops the sender using it, unregisters it, disposes
// of its leftover frames, sends an abort round the ring if c failed here first, and returns
// the error to report.
func (r *Ring) finish(c *call, err error) error {
	// Let a Send in flight finish rather than cancel it: a transport may have to drop the
	// connection when a Send is cut off mid-frame, and the abort must still get through. Only a
	// successor that takes no frame for Timeout, or Close, cuts it off.
	c.timer.Reset(r.cfg.Timeout)
	expired, closed := c.timer.C, r.done
	r.mu.Lock()
	c.ended = true // the sender picks it no more
	for c.sending {
		r.mu.Unlock()
		select {
		case <-c.sentc:
		case <-expired:
			c.cancel()
			expired, closed = nil, nil
		case <-closed:
			c.cancel()
			expired, closed = nil, nil
		}
		r.mu.Lock()
	}
	c.cancel()
	// A frame still being applied or read into c's buffer must stop writing there: the caller
	// owns the buffer again once this returns. c.ended keeps any later frame out of it.
	r.mu.Unlock()
	r.unland(c)
	r.mu.Lock()
	delete(r.mu.active, c.tag)
	for i, x := range r.mu.calls {
		if x == c {
			n := len(r.mu.calls)
			copy(r.mu.calls[i:], r.mu.calls[i+1:])
			r.mu.calls[n-1] = nil
			r.mu.calls = r.mu.calls[:n-1]
			break
		}
	}
	if err != nil && c.tag < MaxUserTag {
		if len(r.mu.dead) >= 1024 {
			clear(r.mu.dead) // bound the set; forgetting an old failure only risks a spurious error
		}
		r.mu.dead[c.tag] = r.mu.seq
	}
	// Frames still queued for c: after a success they can only belong to the next call with the
	// same explicit tag (the predecessor finished first and moved on), so they wait for it;
	// otherwise they are stale.
	keep := err == nil && c.tag < MaxUserTag
	if c.hasHeld {
		r.disposeLocked(c.held, keep)
	}
	for len(c.inbox) > 0 {
		r.disposeLocked(<-c.inbox, keep)
	}
	r.mu.Unlock()

	if err != nil && !c.aborted && !errors.Is(err, ErrClosed) {
		fault := r.rank
		var pe *PeerError
		if errors.As(err, &pe) {
			fault = pe.Rank
		}
		r.originateAbort(c.op, c.tag, fault, err)
	}
	r.putCall(c)
	return err
}

// disposeLocked requeues or releases a frame of a finished call.
func (r *Ring) disposeLocked(f frame, keep bool) {
	if keep {
		r.mu.pending = append(r.mu.pending, f)
		return
	}
	r.release(f)
}

// originateAbort queues an abort for tag naming fault, to start its way round the ring.
func (r *Ring) originateAbort(op uint8, tag uint64, fault int, err error) {
	var a abortMsg
	a.h = Header{Kind: KindAbort, Op: op, Src: uint16(r.rank), Tag: tag, Step: uint32(fault), Piece: uint32(r.rank)}
	a.n = copy(a.reason[:], err.Error())
	a.h.Length = uint32(a.n)
	r.queueAbort(&a)
}

// queueAbort hands an abort to the sender without blocking.
func (r *Ring) queueAbort(a *abortMsg) {
	if r.size == 1 {
		return
	}
	r.aborts.Add(1)
	select {
	case r.ctrl <- *a:
		select {
		case r.wake <- struct{}{}:
		default:
		}
	default:
		r.aborts.Add(-1)
	}
}

// getBuf returns a receive buffer, allocating up to recvBuffers of them and then waiting for
// one to be released (back-pressure). nil once the Ring is closed.
func (r *Ring) getBuf() []byte {
	if b := r.popFree(); b != nil {
		return b
	}
	if r.nbufs.Load() < r.maxBufs { // only the dispatcher allocates, so this cannot overshoot
		r.nbufs.Add(1)
		return alignedBytes(r.bufSize)
	}
	for {
		select {
		case <-r.freed:
			if b := r.popFree(); b != nil {
				return b
			}
		case <-r.done:
			return nil
		}
	}
}

// popFree takes the most recently released buffer, or nil.
func (r *Ring) popFree() []byte {
	r.freeMu.Lock()
	defer r.freeMu.Unlock()
	n := len(r.free)
	if n == 0 {
		return nil
	}
	b := r.free[n-1]
	r.free[n-1] = nil
	r.free = r.free[:n-1]
	return b
}

// putFree returns a buffer to the pool; never blocks.
func (r *Ring) putFree(b []byte) {
	r.freeMu.Lock()
	r.free = append(r.free, b)
	r.freeMu.Unlock()
	select {
	case r.freed <- struct{}{}:
	default:
	}
}

// release returns a frame's buffer to the pool. The pool has room for every buffer ever
// allocated, so this never blocks.
func (r *Ring) release(f frame) {
	if f.buf != nil {
		r.putFree(f.buf[:cap(f.buf)])
	}
}

// getCall takes a call state from the pool.
func (r *Ring) getCall() *call {
	r.mu.Lock()
	defer r.mu.Unlock()
	if n := len(r.mu.idle); n > 0 {
		c := r.mu.idle[n-1]
		r.mu.idle = r.mu.idle[:n-1]
		return c
	}
	return newCall(r)
}

// putCall returns a call state to the pool.
func (r *Ring) putCall(c *call) {
	c.reset()
	r.mu.Lock()
	if len(r.mu.idle) < 64 {
		r.mu.idle = append(r.mu.idle, c)
	}
	r.mu.Unlock()
}
