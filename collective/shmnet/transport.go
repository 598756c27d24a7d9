//go:build linux

package shmnet

import (
	"context"
	"crypto/hmac"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/qvd/qvd/collective"
)

// transport is one rank's end of a shared-memory group.
type transport struct {
	cfg        Config
	log        *zap.Logger
	rank, size int
	addrs      []string
	closed     atomic.Bool
	once       sync.Once

	own      *segment   // this rank's segment: it receives in slot p from rank p
	peers    []*segment // peers[p]: p's segment, where this rank sends in slot rank
	attached []bool     // attached[p]: p has attached to own, with a verified proof
	in       []*inLink  // in[p]: frames from p
	out      []*outLink // out[p]: frames to p

	// The direct path's (shared.go): the arena's allocator; hold, which Close takes to wait
	// out the calls reading the peers' mappings; the futex timeouts of Await, per peer.
	arena  arena
	hold   sync.RWMutex
	postTS []unix.Timespec
}

var (
	_ collective.Transport      = (*transport)(nil)
	_ collective.DirectReceiver = (*transport)(nil)
	_ collective.ApplyReceiver  = (*transport)(nil)
)

// outLink sends to one peer. Its mutex serialises Sends to that peer (the Transport contract
// lets them be concurrent) and Close's wait for them.
type outLink struct {
	mu         sync.Mutex
	peer       int
	r          *ring
	seg        *segment       // the peer's segment
	peerClosed *atomic.Uint32 // the peer closed its transport
	lockFd     int            // the peer's segment, whose creator's lock says it is alive
	head       uint64         // the sender's published head (only this side writes it)
	err        error          // sticky: a frame was abandoned half-written
	ts         unix.Timespec
}

// inLink receives from one peer; its mutex hands the link from one Recv to the next.
type inLink struct {
	mu     sync.Mutex
	peer   int
	r      *ring
	lockFd int    // the peer's segment, whose creator's lock says it is alive
	tail   uint64 // the receiver's published tail (only this side writes it)
	skip   uint64 // payload bytes left of a frame whose Recv was cut short, to discard
	err    error  // sticky: the stream is out of step (a malformed header)
	ts     unix.Timespec
}

// New attaches this rank to the group's segments, waiting up to cfg.AttachTimeout (and ctx)
// for every peer.
func New(ctx context.Context, g Group, cfg Config, log *zap.Logger) (collective.Transport, error) {
	return open(ctx, g, cfg, log, os.Getpid())
}

// open is New with this rank's pid given, so tests can run several ranks in one process
// (the pid only names segments and appears in messages).
func open(ctx context.Context, g Group, cfg Config, log *zap.Logger, pid int) (*transport, error) {
	if err := g.validate(); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("shmnet: config: %w", err)
	}
	if log == nil {
		log = zap.NewNop()
	}
	dir := g.dir()
	log = log.With(zap.String("job", g.Job), zap.Int("rank", g.Rank))
	if err := sweep(dir, log); err != nil {
		return nil, err
	}
	t := &transport{
		cfg: cfg, log: log, rank: g.Rank, size: g.Size,
		peers:    make([]*segment, g.Size),
		attached: make([]bool, g.Size),
		in:       make([]*inLink, g.Size),
		out:      make([]*outLink, g.Size),
		postTS:   make([]unix.Timespec, g.Size),
	}
	t.addrs = make([]string, g.Size)
	if g.Size == 1 {
		t.addrs[0] = addrOr(g.Addrs, 0, pid)
		return t, nil
	}
	own, err := createSegment(dir, g.Job, g.Rank, g.Size, cfg.RingBytes, cfg.ArenaBytes, pid, g.Secret)
	if err != nil {
		return nil, err
	}
	t.own = own
	if err := t.mapArena(cfg.ArenaBytes); err != nil {
		_ = unix.Unlink(own.path)
		own.unmap()
		return nil, err
	}
	unlinked := false
	fail := func(err error) (*transport, error) {
		// Peers that attached already must not wait on a rank that gave up.
		own.closedWord().Store(1)
		for p := range g.Size {
			if p == g.Rank {
				continue
			}
			own.slot(p).wakeAll()
			if seg := t.peers[p]; seg != nil {
				seg.slot(g.Rank).prodState.Store(prodClosed)
				seg.slot(g.Rank).wakeAll()
			}
		}
		if !unlinked {
			_ = unix.Unlink(own.path)
		}
		t.closeArena()
		t.unmapAll()
		return nil, err
	}

	attachCtx, cancel := context.WithTimeout(ctx, cfg.AttachTimeout)
	defer cancel()
	pause := 200 * time.Microsecond
	for {
		progress, err := t.attachStep(dir, g, pid)
		if err != nil {
			return fail(err)
		}
		if t.attachedAll() {
			break
		}
		if progress {
			pause = 200 * time.Microsecond
		}
		select {
		case <-attachCtx.Done():
			if ctx.Err() != nil {
				return fail(fmt.Errorf("shmnet: job %s rank %d attaching: %w", g.Job, g.Rank, ctx.Err()))
			}
			return fail(t.attachTimeout(dir, g))
		case <-time.After(pause):
		}
		pause = min(2*pause, 10*time.Millisecond)
	}
	// Every peer has mapped this segment: the name has done its job. From here on a crash of
	// any process leaves nothing behind, since mappings die with their processes.
	if err := unix.Unlink(own.path); err != nil {
		return fail(fmt.Errorf("shmnet: unlinking %s: %w", own.path, err))
	}
	unlinked = true
	for p := range g.Size {
		if p == g.Rank {
			continue
		}
		// The process that made p's segment is the one that attached to this one: its attach
		// record carries that segment's nonce (under its proof). Pids could not tell, as
		// ranks in containers sharing an IPC namespace may all be pid 1.
		sl := own.slot(p)
		if got := sl.ctl[slotNonce : slotNonce+len(t.peers[p].nonce)]; !hmac.Equal(got, t.peers[p].nonce[:]) {
			return fail(fmt.Errorf("shmnet: rank %d attached to %s from a process (pid %d) other than the one that made its segment %s (pid %d): %w",
				p, own.path, int64(binary.LittleEndian.Uint64(sl.ctl[slotPid:])), t.peers[p].path, t.peers[p].pid, collective.ErrAuth))
		}
		t.addrs[p] = addrOr(g.Addrs, p, t.peers[p].pid)
		t.in[p] = &inLink{peer: p, r: own.slot(p), lockFd: t.peers[p].fd}
		t.out[p] = &outLink{peer: p, r: t.peers[p].slot(g.Rank), seg: t.peers[p],
			peerClosed: t.peers[p].closedWord(), lockFd: t.peers[p].fd}
	}
	t.addrs[g.Rank] = addrOr(g.Addrs, g.Rank, pid)
	log.Debug("shared-memory transport attached", zap.Int("size", g.Size), zap.String("dir", dir))
	return t, nil
}

func addrOr(addrs []string, r, pid int) string {
	if addrs != nil {
		return addrs[r]
	}
	return "pid " + strconv.Itoa(pid)
}

// attachStep maps the peers' segments that have appeared and checks the peers that have
// attached to this rank's; it reports whether anything moved. A segment or proof that fails
// a check is an error at once: waiting would not make it verify.
func (t *transport) attachStep(dir string, g Group, pid int) (bool, error) {
	progress := false
	var ents []os.DirEntry
	for p := range g.Size {
		if p == g.Rank || t.peers[p] != nil {
			continue
		}
		if ents == nil {
			var err error
			if ents, err = os.ReadDir(dir); err != nil {
				return false, fmt.Errorf("shmnet: listing %s: %w", dir, err)
			}
		}
		seg, err := t.attachPeer(dir, ents, g, p, pid)
		if err != nil {
			return false, err
		}
		if seg != nil {
			t.peers[p] = seg
			progress = true
		}
	}
	for p := range g.Size {
		if p == g.Rank || t.attached[p] {
			continue
		}
		sl := t.own.slot(p)
		if sl.attached.Load() == 0 {
			continue
		}
		got := int(int64(binary.LittleEndian.Uint64(sl.ctl[slotPid:])))
		if !hmac.Equal(sl.ctl[slotPf:slotPf+macSize], proof(g.Secret, g.Job, g.Rank, p, got, t.own.nonce[:], sl.ctl[slotNonce:slotNonce+16])) {
			return false, fmt.Errorf("shmnet: rank %d attached to %s without proving the job's secret: %w", p, t.own.path, collective.ErrAuth)
		}
		t.attached[p] = true
		progress = true
	}
	return progress, nil
}

// attachPeer looks for rank p's segment among ents and, if it is there and ready, maps it,
// proves this rank's membership in its slot there, and returns it (nil, nil: not yet).
func (t *transport) attachPeer(dir string, ents []os.DirEntry, g Group, p, pid int) (*segment, error) {
	prefix := "qvd-" + g.Job + "-" + strconv.Itoa(p) + "-"
	var found *segment
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, prefix) || !allDigits(name[len(prefix):]) {
			continue
		}
		cpid, _ := strconv.Atoi(name[len(prefix):])
		path := dir + "/" + name
		seg, err := openSegment(path, g.Job, p, g.Size, cpid, g.Secret)
		if errors.Is(err, errNotReady) {
			continue // being written, or a dead process's leftover (the next sweep removes it)
		}
		if err != nil {
			if found != nil {
				found.unmap()
			}
			return nil, err
		}
		if found != nil {
			found.unmap()
			seg.unmap()
			return nil, fmt.Errorf("shmnet: two live processes (pids %d and %d) claim rank %d of job %s in %s", found.pid, cpid, p, g.Job, dir)
		}
		found = seg
	}
	if found == nil {
		return nil, nil
	}
	sl := found.slot(g.Rank)
	if sl.attached.Load() != 0 {
		found.unmap()
		return nil, fmt.Errorf("shmnet: another process already attached to %s as rank %d", found.path, g.Rank)
	}
	binary.LittleEndian.PutUint64(sl.ctl[slotPid:], uint64(pid))
	copy(sl.ctl[slotNonce:], t.own.nonce[:])
	copy(sl.ctl[slotPf:], proof(g.Secret, g.Job, p, g.Rank, pid, found.nonce[:], t.own.nonce[:]))
	sl.attached.Store(1)
	return found, nil
}

func (t *transport) attachedAll() bool {
	for p := range t.size {
		if p != t.rank && (t.peers[p] == nil || !t.attached[p]) {
			return false
		}
	}
	return true
}

// attachTimeout names the ranks that never showed up, and what was missing from each.
func (t *transport) attachTimeout(dir string, g Group) error {
	var noSeg, noAttach []string
	for p := range g.Size {
		if p == g.Rank {
			continue
		}
		if t.peers[p] == nil {
			noSeg = append(noSeg, strconv.Itoa(p))
		}
		if !t.attached[p] {
			noAttach = append(noAttach, strconv.Itoa(p))
		}
	}
	var why []string
	if len(noSeg) > 0 {
		why = append(why, fmt.Sprintf("no segment from rank(s) %s in %s", strings.Join(noSeg, ","), dir))
	}
	if len(noAttach) > 0 {
		why = append(why, fmt.Sprintf("rank(s) %s did not attach to %s", strings.Join(noAttach, ","), t.own.path))
	}
	return fmt.Errorf("shmnet: job %s rank %d: attaching timed out after %v: %s: %w", g.Job, g.Rank,
		t.cfg.AttachTimeout, strings.Join(why, "; "), collective.ErrTimeout)
}

func (t *transport) Rank() int { return t.rank }
func (t *transport) Size() int { return t.size }

func (t *transport) Addr(r int) string {
	if r < 0 || r >= t.size {
		return ""
	}
	return t.addrs[r]
}

func (t *transport) errClosed() error {
	return fmt.Errorf("shmnet: rank %d: %w", t.rank, collective.ErrClosed)
}

func (t *transport) peerErr(peer int, err error) error {
	return &collective.PeerError{Rank: peer, Addr: t.addrs[peer], Err: err}
}

func (t *transport) checkPeer(what string, peer int) error {
	if peer < 0 || peer >= t.size {
		return fmt.Errorf("shmnet: %s rank %d outside a group of %d", what, peer, t.size)
	}
	if peer == t.rank {
		return fmt.Errorf("shmnet: rank %d: %s itself is not supported", t.rank, what)
	}
	return nil
}

// Send copies the frame into the ring to peer, waiting for room; it returns once the whole
// frame is in shared memory.
func (t *transport) Send(ctx context.Context, peer int, h collective.Header, payload []byte) error {
	if err := t.checkPeer("send to", peer); err != nil {
		return err
	}
	if int(h.Length) != len(payload) {
		return fmt.Errorf("shmnet: send: header length %d, payload %d bytes", h.Length, len(payload))
	}
	if len(payload) > collective.MaxPayload {
		return fmt.Errorf("shmnet: send: payload of %d bytes exceeds the %d limit", len(payload), collective.MaxPayload)
	}
	l := t.out[peer]
	l.mu.Lock()
	defer l.mu.Unlock()
	if t.closed.Load() {
		return t.errClosed()
	}
	if l.err != nil {
		return l.err
	}
	if l.peerClosed.Load() != 0 {
		return t.peerErr(peer, fmt.Errorf("%w: rank %d closed its transport", collective.ErrPeerGone, peer))
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if !l.seg.reserved {
		if err := l.seg.reserve(t.rank); err != nil {
			l.err = err
			return err
		}
	}
	r := l.r
	size := r.size()
	start := align(l.head)
	n := uint64(len(payload))
	// Room for the whole record, or, for a frame larger than the ring can hold at once, for
	// the header and a first piece. Until something is written, failing leaves the link in
	// step.
	need := recordHeader + n
	if need > size-recordAlign {
		need = recordHeader + min(n, r.step())
	}
	if start+need > size {
		if err := t.wait(ctx, peer, &r.space, r.tail, start+need-size, l.lockFd, l.gone, &l.ts); err != nil {
			return err
		}
	}
	var hb [recordHeader]byte
	collective.PutHeader(hb[:], h)
	r.put(start, hb[:])
	w := start + recordHeader
	step := r.step()
	for len(payload) > 0 {
		free := r.tail.Load() + size - w
		if free == 0 {
			r.publishHead(w)
			want := w + min(uint64(len(payload)), size/2) - size
			if err := t.wait(ctx, peer, &r.space, r.tail, want, l.lockFd, l.gone, &l.ts); err != nil {
				// Part of the frame is out: the receiver cannot resync, so the link is done.
				r.prodState.Store(prodCut)
				r.wakeAll()
				l.head = w
				l.err = t.peerErr(peer, fmt.Errorf("%w: a frame to rank %d was abandoned half-sent (%v)", collective.ErrPeerGone, peer, err))
				return err
			}
			continue
		}
		k := min(uint64(len(payload)), free, step)
		r.put(w, payload[:k])
		w += k
		payload = payload[k:]
		if len(payload) > 0 {
			r.publishHead(w)
		}
	}
	r.publishHead(w)
	l.head = w
	return nil
}

// gone reports the receiver's graceful close.
func (l *outLink) gone() error {
	if l.peerClosed.Load() != 0 {
		return fmt.Errorf("%w: rank %d closed its transport", collective.ErrPeerGone, l.peer)
	}
	return nil
}

// Recv returns the next frame from peer, its payload copied into buf.
func (t *transport) Recv(ctx context.Context, peer int, buf []byte) (collective.Header, []byte, error) {
	return t.recv(ctx, peer, buf, nil, nil)
}

// RecvInto is Recv, except that a data frame's payload is copied straight out of the ring
// into dst(h) when dst names a slice of exactly h.Length bytes: the only copy on the
// receiving side.
func (t *transport) RecvInto(ctx context.Context, peer int, buf []byte, dst func(collective.Header) []byte) (collective.Header, []byte, error) {
	return t.recv(ctx, peer, buf, dst, nil)
}

// RecvApply is Recv, except that a data frame for which apply(h) returns a function is
// handed to that function where it lies in the ring, in parts of up to publishBytes
// (collective.ApplyAlign-aligned, never wrapping round the ring's end), each part's room
// given back to the sender once the function returns: no copy at all on the receiving side.
func (t *transport) RecvApply(ctx context.Context, peer int, buf []byte, apply func(collective.Header) func(off int, p []byte)) (collective.Header, []byte, error) {
	return t.recv(ctx, peer, buf, nil, apply)
}

// recv is Recv, RecvInto and RecvApply.
func (t *transport) recv(ctx context.Context, peer int, buf []byte, dst func(collective.Header) []byte,
	apply func(collective.Header) func(off int, p []byte)) (collective.Header, []byte, error) {
	if err := t.checkPeer("receive from", peer); err != nil {
		return collective.Header{}, nil, err
	}
	l := t.in[peer]
	l.mu.Lock()
	defer l.mu.Unlock()
	if t.closed.Load() {
		return collective.Header{}, nil, t.errClosed()
	}
	if l.err != nil {
		return collective.Header{}, nil, l.err
	}
	r := l.r
	rd := l.tail
	for l.skip > 0 {
		// The rest of a frame whose Recv ended early: dropped, so the stream stays in step.
		if avail := r.head.Load() - rd; avail > 0 {
			k := min(avail, l.skip)
			rd += k
			l.skip -= k
			l.tail = rd
			r.publishTail(rd)
			continue
		}
		if err := t.wait(ctx, peer, &r.data, r.head, rd+min(l.skip, r.step()), l.lockFd, l.gone, &l.ts); err != nil {
			return collective.Header{}, nil, err
		}
	}
	start := align(rd)
	if r.head.Load() < start+recordHeader {
		if err := t.wait(ctx, peer, &r.data, r.head, start+recordHeader, l.lockFd, l.gone, &l.ts); err != nil {
			return collective.Header{}, nil, err
		}
	}
	var hb [collective.HeaderSize]byte
	r.get(hb[:], start)
	h, err := collective.ParseHeader(hb[:])
	if err != nil {
		l.err = t.peerErr(peer, err)
		return collective.Header{}, nil, l.err
	}
	n := uint64(h.Length)
	rd = start + recordHeader
	var out []byte
	if apply != nil && h.Kind == collective.KindData {
		if fn := apply(h); fn != nil {
			return t.recvApply(ctx, l, h, rd, fn)
		}
	}
	if dst != nil && h.Kind == collective.KindData {
		if d := dst(h); d != nil && uint64(len(d)) == n {
			out = d
		}
	}
	if out == nil {
		if n > uint64(len(buf)) {
			l.tail, l.skip = rd, n
			r.publishTail(rd)
			return collective.Header{}, nil, t.peerErr(peer, fmt.Errorf("%w: frame of %d bytes, receive buffer holds %d",
				collective.ErrProtocol, n, len(buf)))
		}
		out = buf[:n]
	}
	step := r.step()
	for got := uint64(0); got < n; {
		avail := r.head.Load() - rd
		if avail == 0 {
			if err := t.wait(ctx, peer, &r.data, r.head, rd+min(n-got, step), l.lockFd, l.gone, &l.ts); err != nil {
				l.tail, l.skip = rd, n-got
				return collective.Header{}, nil, err
			}
			continue
		}
		k := min(avail, n-got, step)
		r.get(out[got:got+k], rd)
		rd += k
		got += k
		r.publishTail(rd)
	}
	l.tail = rd
	r.publishTail(rd)
	return h, out, nil
}

// recvApply hands the payload of h, which starts at rd, to fn in place (under l.mu). Parts
// end where the ring wraps or where the sender has published so far, rounded down to
// collective.ApplyAlign unless they finish the frame: payloads start on a cache line and
// the ring's size is a power of two, so a part only ever ends unaligned at the frame's end.
func (t *transport) recvApply(ctx context.Context, l *inLink, h collective.Header, rd uint64, fn func(off int, p []byte)) (collective.Header, []byte, error) {
	r := l.r
	n := uint64(h.Length)
	step := r.step()
	for got := uint64(0); got < n; {
		left := n - got
		k := min(r.head.Load()-rd, left, step)
		if k < left {
			k &^= collective.ApplyAlign - 1
		}
		if k == 0 {
			if err := t.wait(ctx, l.peer, &r.data, r.head, rd+min(left, step), l.lockFd, l.gone, &l.ts); err != nil {
				l.tail, l.skip = rd, left
				return collective.Header{}, nil, err
			}
			continue
		}
		i := rd & r.mask
		k = min(k, r.size()-i)
		fn(int(got), r.buf[i:i+k:i+k])
		rd += k
		got += k
		r.publishTail(rd)
	}
	l.tail = rd
	r.publishTail(rd)
	return h, nil, nil
}

// gone reports the sender's graceful close or an abandoned frame.
func (l *inLink) gone() error {
	switch l.r.prodState.Load() {
	case prodClosed:
		return fmt.Errorf("%w: rank %d closed its transport", collective.ErrPeerGone, l.peer)
	case prodCut:
		return fmt.Errorf("%w: rank %d abandoned a frame half-sent", collective.ErrPeerGone, l.peer)
	}
	return nil
}

// wait blocks until counter reaches want: first spinning for cfg.Spin (yielding, so ranks
// sharing a core make progress), then sleeping on w's futex with a PollInterval timeout,
// after which it checks ctx and whether the peer still holds the lock on its segment
// (lockFd; see lock.go). It fails with ErrClosed once the transport closes, ctx's error once
// ctx ends, and a *PeerError wrapping ErrPeerGone once the peer has closed (and no more data
// is coming) or its process has exited.
func (t *transport) wait(ctx context.Context, peer int, w *waitWord, counter *atomic.Uint64, want uint64, lockFd int, gone func() error, ts *unix.Timespec) error {
	if counter.Load() >= want {
		return nil
	}
	if t.cfg.Spin > 0 {
		start := time.Now()
		for i := 1; ; i++ {
			runtime.Gosched()
			if counter.Load() >= want {
				return nil
			}
			if i%16 == 0 && (time.Since(start) >= t.cfg.Spin || t.closed.Load()) {
				break
			}
		}
	}
	for {
		if t.closed.Load() {
			return t.errClosed()
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := gone(); err != nil {
			// The peer published before it closed: what is there is still delivered.
			if counter.Load() >= want {
				return nil
			}
			return t.peerErr(peer, err)
		}
		d := t.cfg.PollInterval
		if dl, ok := ctx.Deadline(); ok {
			d = min(d, max(time.Until(dl), 50*time.Microsecond))
		}
		w.want.Store(want)
		w.waiting.Store(1)
		seq := w.seq.Load()
		if counter.Load() >= want {
			w.waiting.Store(0)
			return nil
		}
		timedOut := futexWait(w.seq, seq, d, ts)
		w.waiting.Store(0)
		if counter.Load() >= want {
			return nil
		}
		if timedOut {
			dead, err := ownerGone(lockFd)
			if err != nil {
				return t.peerErr(peer, fmt.Errorf("%w: cannot tell whether it is alive: %w", collective.ErrPeerGone, err))
			}
			if dead {
				if counter.Load() >= want {
					return nil
				}
				return t.peerErr(peer, fmt.Errorf("%w: its process exited (it no longer holds its segment's lock)", collective.ErrPeerGone))
			}
		}
	}
}

// Close marks this rank's rings closed (its peers' blocked calls fail with ErrPeerGone),
// wakes its own blocked calls (they return ErrClosed), waits for them and unmaps. Safe twice.
func (t *transport) Close() error {
	t.once.Do(func() { t.shutdown(true) })
	return nil
}

// shutdown is Close; graceful false leaves the flags alone, as a crash would (tests).
func (t *transport) shutdown(graceful bool) {
	t.closed.Store(true)
	if t.own == nil {
		return // a group of one
	}
	t.wakeAwaiters()
	if graceful {
		t.own.closedWord().Store(1)
	}
	for p := range t.size {
		if p == t.rank || t.in[p] == nil {
			continue
		}
		if graceful {
			t.out[p].r.prodState.CompareAndSwap(prodOpen, prodClosed)
		}
		t.in[p].r.wakeAll()
		t.out[p].r.wakeAll()
	}
	for p := range t.size {
		if p == t.rank || t.in[p] == nil {
			continue
		}
		// Every call checks closed under its link's lock before touching the mapping, so
		// once each lock has been taken here, nothing touches it again.
		t.in[p].mu.Lock()
		t.in[p].mu.Unlock() //nolint:staticcheck // an empty critical section: waiting out the holder
		t.out[p].mu.Lock()
		t.out[p].mu.Unlock() //nolint:staticcheck
	}
	// The direct path's calls read the peers' mappings under hold.
	t.hold.Lock()
	t.hold.Unlock() //nolint:staticcheck // waiting out the holders
	t.closeArena()
	t.unmapAll()
}

// unmapAll releases every mapping and descriptor; closing the own segment's descriptor
// drops this rank's lock, which tells its peers it is gone.
func (t *transport) unmapAll() {
	for _, s := range t.peers {
		if s != nil {
			s.unmap()
		}
	}
	if t.own != nil {
		t.own.unmap()
	}
}

// Available reports whether shared memory can be used here (dir exists, is writable, and
// a file in it can be sized, reserved, mapped and used for a futex); the error says why not.
// "" means /dev/shm.
func Available(dir string) error {
	if dir == "" {
		dir = DefaultDir
	}
	st, err := os.Stat(dir)
	if err != nil {
		return fmt.Errorf("shmnet: %w", err)
	}
	if !st.IsDir() {
		return fmt.Errorf("shmnet: %s is not a directory", dir)
	}
	f, err := os.CreateTemp(dir, ".qvd-probe-")
	if err != nil {
		return fmt.Errorf("shmnet: cannot create files in %s: %w", dir, err)
	}
	defer func() { _ = f.Close() }()
	_ = os.Remove(f.Name())
	fd := int(f.Fd())
	if err := unix.Ftruncate(fd, pageSize); err != nil {
		return fmt.Errorf("shmnet: sizing a file in %s: %w", dir, err)
	}
	if err := unix.Fallocate(fd, 0, 0, pageSize); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		return fmt.Errorf("shmnet: reserving memory in %s: %w", dir, err)
	}
	mem, err := unix.Mmap(fd, 0, pageSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("shmnet: mapping a file in %s: %w", dir, err)
	}
	defer func() { _ = unix.Munmap(mem) }()
	s := &segment{mem: mem}
	w := s.u32(0)
	w.Store(1)
	var ts unix.Timespec
	futexWait(w, 0, time.Millisecond, &ts) // value differs: returns at once if futexes work
	futexWake(w)
	return nil
}
