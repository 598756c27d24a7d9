//go:build linux

package shmnet

import (
	"context"
	"fmt"
	"runtime"
	"sort"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/qvd/qvd/collective"
)

// The shared arena and the progress record: the transport's collective.SharedMemory, which
// the Ring's direct path runs on (collective/direct.go).
//
// Arena. The last Config.ArenaBytes of each rank's segment. Every peer maps the whole
// segment at attach, arena included, so a buffer allocated here later is readable by all of
// them at its offset, with no further exchange of names or descriptors. The arena is a hole
// in the file: AllocShared reserves a buffer's pages with fallocate (a full tmpfs is an error
// then, not a SIGBUS later) and FreeShared punches them out again. The creator maps its arena
// apart from the rest of its segment, so that Close can unmap everything but the buffers
// still allocated: those stay valid (as memory of this process, the segment's name long
// gone) until FreeShared unmaps them, so a caller that frees after Close neither faults nor
// leaks.
//
// Progress record. A cache line of the header holds this rank's collective.Posted, the step
// stored last; the next line a futex word and the count of peers sleeping on it. Await polls
// the peer's step (Config.Spin, as Send and Recv do), then counts itself in, rechecks and
// sleeps on the futex with a PollInterval timeout, probing the peer's segment lock on every
// timeout as the rings do: a peer killed in the middle of a direct call is named within about
// PollInterval. Post stores the step, then wakes only if someone sleeps: sequentially
// consistent atomics on both sides, so no wake-up is lost.

var _ collective.SharedMemory = (*transport)(nil)

// arena is this rank's allocator over its arena (transport.arena).
type arena struct {
	mu     sync.Mutex
	base   unsafe.Pointer // the arena's mapping; nil: none (ArenaBytes 0, or a group of one)
	size   int64
	off    int64           // where the arena starts in the segment file
	free   []span          // free runs, sorted by offset, coalesced
	used   map[int64]int64 // allocated runs: offset → bytes
	closed bool            // the transport closed: free runs are unmapped, FreeShared unmaps
}

type span struct{ off, n int64 }

// mapArena maps the arena of this rank's freshly created segment.
func (t *transport) mapArena(size int64) error {
	a := &t.arena
	a.size, a.off = size, arenaOffset(t.size, t.own.ringBytes)
	if size == 0 {
		return nil
	}
	// Through a descriptor of its own: a mapping holds its open file description, and the
	// flock that tells the peers this rank is alive belongs to the description of own.fd,
	// so a buffer still mapped after Close must not keep that one (and the lock) alive.
	fd, err := unix.Open(t.own.path, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("shmnet: opening %s for its arena: %w", t.own.path, err)
	}
	defer func() { _ = unix.Close(fd) }()
	var a1, a2 unix.Stat_t
	if err := unix.Fstat(fd, &a1); err != nil {
		return fmt.Errorf("shmnet: stat of %s: %w", t.own.path, err)
	}
	if err := unix.Fstat(t.own.fd, &a2); err != nil || a1.Dev != a2.Dev || a1.Ino != a2.Ino {
		return fmt.Errorf("shmnet: %s is not the segment this rank created", t.own.path)
	}
	p, err := unix.MmapPtr(fd, a.off, nil, uintptr(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("shmnet: mapping the arena of %s: %w", t.own.path, err)
	}
	a.base = p
	a.free = []span{{0, size}}
	a.used = make(map[int64]int64)
	return nil
}

// closeArena unmaps what no buffer needs: everything once nothing is allocated, else the
// free runs (the buffers stay mapped until FreeShared). It runs before own.fd closes: from
// here on the allocator no longer touches the descriptor.
func (t *transport) closeArena() {
	a := &t.arena
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.base == nil || a.closed {
		return
	}
	a.closed = true
	if len(a.used) == 0 {
		_ = unix.MunmapPtr(a.base, uintptr(a.size))
		return
	}
	for _, s := range a.free {
		_ = unix.MunmapPtr(unsafe.Add(a.base, s.off), uintptr(s.n))
	}
	a.free = nil
}

// AllocShared returns n zeroed float32s in this rank's arena, page-aligned.
func (t *transport) AllocShared(n int) ([]float32, error) {
	a := &t.arena
	if n <= 0 {
		return nil, fmt.Errorf("shmnet: allocating %d elements", n)
	}
	bytes := (int64(n)*4 + pageSize - 1) &^ (pageSize - 1)
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.base == nil:
		return nil, fmt.Errorf("shmnet: rank %d has no shared arena: %w", t.rank, collective.ErrNoShared)
	case a.closed:
		return nil, t.errClosed()
	}
	i := 0 // first fit
	for i < len(a.free) && a.free[i].n < bytes {
		i++
	}
	if i == len(a.free) {
		return nil, fmt.Errorf("shmnet: rank %d: no free run of %d bytes in the %d-byte arena (arena_bytes): %w",
			t.rank, bytes, a.size, collective.ErrNoShared)
	}
	off := a.free[i].off
	if err := unix.Fallocate(t.own.fd, 0, a.off+off, bytes); err != nil {
		return nil, fmt.Errorf("shmnet: rank %d: reserving %d bytes in %s: %v (is the shared-memory filesystem too small? docker: --shm-size): %w",
			t.rank, bytes, t.own.path, err, collective.ErrNoShared)
	}
	if a.free[i].n == bytes {
		a.free = append(a.free[:i], a.free[i+1:]...)
	} else {
		a.free[i] = span{off + bytes, a.free[i].n - bytes}
	}
	a.used[off] = bytes
	return unsafe.Slice((*float32)(unsafe.Add(a.base, off)), n), nil
}

// FreeShared releases a buffer AllocShared gave: its pages go back to the filesystem (or,
// after Close, its mapping goes).
func (t *transport) FreeShared(buf []float32) error {
	a := &t.arena
	off, ok := t.SharedOffset(buf)
	a.mu.Lock()
	defer a.mu.Unlock()
	bytes, used := a.used[off]
	if !ok || !used {
		return fmt.Errorf("shmnet: rank %d: freeing a buffer AllocShared did not give", t.rank)
	}
	delete(a.used, off)
	if a.closed {
		_ = unix.MunmapPtr(unsafe.Add(a.base, off), uintptr(bytes))
		return nil
	}
	// The pages go now; the range reads as zeros (a hole) until allocated again.
	if err := unix.Fallocate(t.own.fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, a.off+off, bytes); err != nil {
		t.log.Debug("punching out a freed shared buffer")
	}
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i].off > off })
	a.free = append(a.free, span{})
	copy(a.free[i+1:], a.free[i:])
	a.free[i] = span{off, bytes}
	// Coalesce with the neighbours.
	if i+1 < len(a.free) && a.free[i].off+a.free[i].n == a.free[i+1].off {
		a.free[i].n += a.free[i+1].n
		a.free = append(a.free[:i+1], a.free[i+2:]...)
	}
	if i > 0 && a.free[i-1].off+a.free[i-1].n == a.free[i].off {
		a.free[i-1].n += a.free[i].n
		a.free = append(a.free[:i], a.free[i+1:]...)
	}
	return nil
}

// SharedOffset reports where buf starts in this rank's arena. base and size never change
// once New returns, so this takes no lock (it runs on every collective call).
func (t *transport) SharedOffset(buf []float32) (int64, bool) {
	a := &t.arena
	if a.base == nil || len(buf) == 0 {
		return 0, false
	}
	p, b := uintptr(unsafe.Pointer(unsafe.SliceData(buf))), uintptr(a.base)
	if p < b || p+4*uintptr(len(buf)) > b+uintptr(a.size) {
		return 0, false
	}
	return int64(p - b), true
}

// PeerShared returns peer's n float32s at off of its arena, as mapped here.
func (t *transport) PeerShared(peer int, off int64, n int) ([]float32, error) {
	if peer == t.rank {
		if off < 0 || off%4 != 0 || n < 0 || off+4*int64(n) > t.arena.size {
			return nil, fmt.Errorf("shmnet: bytes [%d, %d) outside the arena: %w", off, off+4*int64(n), collective.ErrProtocol)
		}
		return unsafe.Slice((*float32)(unsafe.Add(t.arena.base, off)), n), nil
	}
	if err := t.checkPeer("read the arena of", peer); err != nil {
		return nil, err
	}
	seg := t.peers[peer]
	if off < 0 || off%4 != 0 || n < 0 || off+4*int64(n) > seg.arena {
		return nil, fmt.Errorf("%w: rank %d names bytes [%d, %d) of its %d-byte arena", collective.ErrProtocol, peer, off, off+4*int64(n), seg.arena)
	}
	if n == 0 {
		return nil, nil
	}
	start := arenaOffset(seg.size, seg.ringBytes) + off
	return unsafe.Slice((*float32)(unsafe.Pointer(&seg.mem[start])), n), nil
}

// postWord is word i of the progress record in seg's header.
func postWord(seg *segment, i int) *atomic.Uint64 { return seg.u64(hdrPosted + 8*int64(i)) }

// Post publishes this rank's record, its step last, and wakes the peers sleeping on it.
func (t *transport) Post(p collective.Posted) {
	s := t.own
	postWord(s, 1).Store(p.Tag)
	postWord(s, 2).Store(uint64(p.Off))
	postWord(s, 3).Store(uint64(p.N))
	postWord(s, 4).Store(p.Call)
	postWord(s, 5).Store(p.Shards)
	postWord(s, 6).Store(uint64(p.Fault))
	postWord(s, 0).Store(p.Step)
	if s.u32(hdrPostWait).Load() != 0 {
		s.u32(hdrPostSeq).Add(1)
		futexWake(s.u32(hdrPostSeq))
	}
}

// Posted reads peer's record (this rank's own for peer == Rank()).
func (t *transport) Posted(peer int) collective.Posted {
	s := t.own
	if peer != t.rank {
		s = t.peers[peer]
	}
	return collective.Posted{
		Step: postWord(s, 0).Load(), Tag: postWord(s, 1).Load(), Off: int64(postWord(s, 2).Load()),
		N: int64(postWord(s, 3).Load()), Call: postWord(s, 4).Load(), Shards: postWord(s, 5).Load(),
		Fault: int64(postWord(s, 6).Load()),
	}
}

// Await waits until peer's step reaches step (see collective.SharedMemory).
func (t *transport) Await(ctx context.Context, peer int, step uint64, timeout time.Duration) error {
	if err := t.checkPeer("wait for", peer); err != nil {
		return err
	}
	seg := t.peers[peer]
	st := postWord(seg, 0)
	reached := func() bool { v := st.Load(); return v >= step } // an abort has the top bit: ≥ any step
	if !reached() && t.cfg.Spin > 0 {
		start := time.Now()
		for i := 1; !reached(); i++ {
			runtime.Gosched()
			if i%16 == 0 && (time.Since(start) >= t.cfg.Spin || t.closed.Load()) {
				break
			}
		}
	}
	deadline := time.Now().Add(timeout)
	seq, waiting := seg.u32(hdrPostSeq), seg.u32(hdrPostWait)
	ts := &t.postTS[peer]
	for !reached() {
		if t.closed.Load() {
			return t.errClosed()
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if seg.closedWord().Load() != 0 {
			return t.peerErr(peer, fmt.Errorf("%w: rank %d closed its transport", collective.ErrPeerGone, peer))
		}
		now := time.Now()
		if !now.Before(deadline) {
			return t.peerErr(peer, fmt.Errorf("%w: rank %d made no progress in a call on shared buffers for %v", collective.ErrTimeout, peer, timeout))
		}
		d := min(t.cfg.PollInterval, deadline.Sub(now))
		if dl, ok := ctx.Deadline(); ok {
			d = min(d, max(time.Until(dl), 50*time.Microsecond))
		}
		waiting.Add(1)
		v := seq.Load()
		if reached() {
			waiting.Add(^uint32(0))
			break
		}
		timedOut := futexWait(seq, v, d, ts)
		waiting.Add(^uint32(0))
		if timedOut && !reached() {
			dead, err := ownerGone(seg.fd)
			if err != nil {
				return t.peerErr(peer, fmt.Errorf("%w: cannot tell whether it is alive: %w", collective.ErrPeerGone, err))
			}
			if dead && !reached() {
				return t.peerErr(peer, fmt.Errorf("%w: its process exited (it no longer holds its segment's lock)", collective.ErrPeerGone))
			}
		}
	}
	if v := st.Load(); v&collective.PostedAbort != 0 {
		return t.abortErr(peer, int(int64(postWord(seg, 6).Load())))
	}
	return nil
}

// abortErr is the error for peer's abort, which blames fault: ErrPeerGone if fault is a
// peer that has died, else ErrAborted.
func (t *transport) abortErr(peer, fault int) error {
	if fault < 0 || fault >= t.size {
		fault = peer
	}
	if fault != t.rank {
		if dead, err := ownerGone(t.peers[fault].fd); err == nil && dead {
			return t.peerErr(fault, fmt.Errorf("%w: its process exited (it no longer holds its segment's lock; rank %d gave up the call)",
				collective.ErrPeerGone, peer))
		}
	}
	return t.peerErr(fault, fmt.Errorf("%w: rank %d gave up the call on shared buffers", collective.ErrAborted, peer))
}

// Hold keeps the mappings until Unhold: Close waits for it.
func (t *transport) Hold() error {
	t.hold.RLock()
	if t.closed.Load() || t.own == nil {
		t.hold.RUnlock()
		return t.errClosed()
	}
	return nil
}

// Unhold ends Hold.
func (t *transport) Unhold() { t.hold.RUnlock() }

// wakeAwaiters wakes this rank's own Awaits, asleep on the peers' futex words, so that they
// see the transport closed (the peers' sleepers wake too, and sleep again).
func (t *transport) wakeAwaiters() {
	for p, seg := range t.peers {
		if p == t.rank || seg == nil || seg.mem == nil {
			continue
		}
		seg.u32(hdrPostSeq).Add(1)
		futexWake(seg.u32(hdrPostSeq))
	}
}
