package collective

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
)

// InprocNet is a group of in-process Transports that pass frames over channels, the
// collective counterpart of hashicorp/raft's in-memory transport: N ranks run as goroutines
// of one test, and the test can delay, drop, partition and kill links to check that every
// failure becomes an error naming the right rank, never a hang.
//
// Each ordered pair of ranks has a link: a channel of at most inprocDepth frames (a full link
// blocks Send, as a full TCP window does). Frames keep their order per link. Faults are
// decided per link: delays and partitions when the frame is received, drops when it is
// sent, from a random stream seeded by (seed, from, to), so the same seed drops the same
// frames of a link whatever the goroutines' interleaving.
type InprocNet struct {
	size  int
	ts    []*inprocTransport
	links [][]*inprocLink // links[from][to]

	mu struct {
		sync.Mutex
		group   []int         // partition group of each rank; all equal when healed
		changed chan struct{} // closed and replaced whenever the partition changes
	}
}

// inprocDepth is how many frames a link holds before Send blocks.
const inprocDepth = 16

// inprocFrame is a frame in flight: a copy of the sender's payload from the link's pool.
type inprocFrame struct {
	h   Header
	p   []byte
	due time.Time // when it may be delivered (delay); zero for at once
}

type inprocLink struct {
	from, to int
	ch       chan inprocFrame
	pool     chan []byte // payload buffers back from the receiver

	mu struct {
		sync.Mutex
		delay   time.Duration
		drop    float64
		rng     *rand.Rand
		lastDue time.Time // delivery times never decrease, so a delay keeps the link's order
	}

	// Receiver side: Recv for one peer is called by one goroutine at a time (Transport
	// contract), but different goroutines may take turns, so the head is kept under a mutex.
	rmu     sync.Mutex
	head    inprocFrame
	hasHead bool
	timer   *time.Timer
}

type inprocTransport struct {
	n        *InprocNet
	rank     int
	once     sync.Once
	done     chan struct{} // closed by Close or Kill
	killOnce sync.Once
	dead     chan struct{} // closed by Kill: the frames it sent are lost
}

// NewInproc returns a connected group of size transports (index = rank) that pass frames
// over channels, with fault injection for tests. Seeded: the same seed gives the same drops.
func NewInproc(size int, seed uint64) (*InprocNet, []Transport) {
	if size < 1 {
		panic(fmt.Sprintf("collective: NewInproc(%d): a group needs at least one rank", size))
	}
	n := &InprocNet{size: size}
	n.mu.group = make([]int, size)
	n.mu.changed = make(chan struct{})
	n.links = make([][]*inprocLink, size)
	for from := range size {
		n.links[from] = make([]*inprocLink, size)
		for to := range size {
			l := &inprocLink{from: from, to: to, ch: make(chan inprocFrame, inprocDepth), pool: make(chan []byte, inprocDepth+4)}
			l.mu.rng = rand.New(rand.NewPCG(seed, uint64(from)<<32|uint64(to)))
			n.links[from][to] = l
		}
	}
	ts := make([]Transport, size)
	n.ts = make([]*inprocTransport, size)
	for r := range size {
		t := &inprocTransport{n: n, rank: r, done: make(chan struct{}), dead: make(chan struct{})}
		n.ts[r], ts[r] = t, t
	}
	return n, ts
}

func (n *InprocNet) check(r int) {
	if r < 0 || r >= n.size {
		panic(fmt.Sprintf("collective: rank %d outside an in-process group of %d", r, n.size))
	}
}

// SetDelay delays every frame sent from→to from now on by d.
func (n *InprocNet) SetDelay(from, to int, d time.Duration) {
	n.check(from)
	n.check(to)
	l := n.links[from][to]
	l.mu.Lock()
	l.mu.delay = d
	l.mu.Unlock()
}

// SetDrop makes each frame sent from→to from now on be lost with probability p.
func (n *InprocNet) SetDrop(from, to int, p float64) {
	n.check(from)
	n.check(to)
	l := n.links[from][to]
	l.mu.Lock()
	l.mu.drop = p
	l.mu.Unlock()
}

// Partition splits the group: frames between ranks of different groups are held, never
// delivered, until Heal (then they arrive, in order). Ranks named in no group form one more
// group together, so Partition([]int{0}) cuts rank 0 off from the rest.
func (n *InprocNet) Partition(groups ...[]int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for i := range n.mu.group {
		n.mu.group[i] = 0
	}
	for g, ranks := range groups {
		for _, r := range ranks {
			n.check(r)
			n.mu.group[r] = g + 1
		}
	}
	n.changedLocked()
}

// Heal ends a partition; held frames are delivered.
func (n *InprocNet) Heal() {
	n.mu.Lock()
	defer n.mu.Unlock()
	clear(n.mu.group)
	n.changedLocked()
}

func (n *InprocNet) changedLocked() {
	close(n.mu.changed)
	n.mu.changed = make(chan struct{})
}

// Kill makes rank die abruptly: its transport closes (its own Sends and Recvs return
// ErrClosed), its peers' Recvs from it return ErrPeerGone, frames it sent and nobody has
// received yet are lost, and Sends to it fail with ErrPeerGone.
func (n *InprocNet) Kill(rank int) {
	n.check(rank)
	t := n.ts[rank]
	t.killOnce.Do(func() { close(t.dead) })
	t.Close()
}

// blocked reports whether from→to is cut by the partition, and the channel that is closed
// when that may change.
func (n *InprocNet) blocked(from, to int) (bool, <-chan struct{}) {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mu.group[from] != n.mu.group[to], n.mu.changed
}

func (t *inprocTransport) Rank() int { return t.rank }
func (t *inprocTransport) Size() int { return t.n.size }

func (t *inprocTransport) Addr(r int) string {
	if r < 0 || r >= t.n.size {
		return ""
	}
	return inprocAddr(r)
}

// inprocAddr names a rank; small ranks come from a table so error paths need not format.
func inprocAddr(r int) string {
	if r < len(inprocAddrs) {
		return inprocAddrs[r]
	}
	return fmt.Sprintf("inproc/%d", r)
}

var inprocAddrs = func() []string {
	a := make([]string, 64)
	for i := range a {
		a[i] = fmt.Sprintf("inproc/%d", i)
	}
	return a
}()

// Close ends the transport as a process closes its sockets: its own Sends and Recvs return
// ErrClosed and Sends to it fail with ErrPeerGone, but the frames it sent before are still
// delivered, as a socket's buffered bytes are before its FIN; a peer's Recv returns
// ErrPeerGone once none is left. A rank that finished its last collective first may so
// close while its peers still read its last frames. Kill loses them instead.
func (t *inprocTransport) Close() error {
	t.once.Do(func() { close(t.done) })
	return nil
}

func (t *inprocTransport) closed() bool { return isClosed(t.done) }

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func (t *inprocTransport) peerGone(peer int) error {
	return &PeerError{Rank: peer, Addr: inprocAddr(peer), Err: ErrPeerGone}
}

// Send copies payload into a pooled buffer and queues it on the link to peer.
func (t *inprocTransport) Send(ctx context.Context, peer int, h Header, payload []byte) error {
	if peer < 0 || peer >= t.n.size {
		return fmt.Errorf("collective: inproc send to rank %d outside a group of %d", peer, t.n.size)
	}
	if int(h.Length) != len(payload) {
		return fmt.Errorf("collective: inproc send: header length %d, payload %d bytes", h.Length, len(payload))
	}
	if t.closed() {
		return fmt.Errorf("collective: inproc rank %d: %w", t.rank, ErrClosed)
	}
	dst := t.n.ts[peer]
	if dst.closed() {
		return t.peerGone(peer)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	l := t.n.links[t.rank][peer]
	l.mu.Lock()
	if l.mu.drop > 0 && l.mu.rng.Float64() < l.mu.drop {
		l.mu.Unlock()
		return nil // lost on the way, as far as the sender can tell
	}
	f := inprocFrame{h: h}
	if l.mu.delay > 0 {
		f.due = time.Now().Add(l.mu.delay)
		if f.due.Before(l.mu.lastDue) {
			f.due = l.mu.lastDue
		}
		l.mu.lastDue = f.due
	}
	l.mu.Unlock()

	var b []byte
	select {
	case b = <-l.pool:
	default:
	}
	if cap(b) < len(payload) {
		b = make([]byte, len(payload))
	}
	f.p = b[:len(payload)]
	copy(f.p, payload)
	select {
	case l.ch <- f:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-t.done:
		return fmt.Errorf("collective: inproc rank %d: %w", t.rank, ErrClosed)
	case <-dst.done:
		return t.peerGone(peer)
	}
}

// Recv returns the next frame from peer, copied into buf.
func (t *inprocTransport) Recv(ctx context.Context, peer int, buf []byte) (Header, []byte, error) {
	if peer < 0 || peer >= t.n.size {
		return Header{}, nil, fmt.Errorf("collective: inproc recv from rank %d outside a group of %d", peer, t.n.size)
	}
	l := t.n.links[peer][t.rank]
	src := t.n.ts[peer]
	l.rmu.Lock()
	defer l.rmu.Unlock()
	for {
		// Closing and death win over frames that are ready: a killed peer's queued frames
		// are lost, as bytes in a dead process's socket buffer are. A closed peer's are
		// delivered first.
		if t.closed() {
			return Header{}, nil, fmt.Errorf("collective: inproc rank %d: %w", t.rank, ErrClosed)
		}
		if isClosed(src.dead) {
			return Header{}, nil, t.peerGone(peer)
		}
		if !l.hasHead && src.closed() {
			select {
			case l.head = <-l.ch:
				l.hasHead = true
			default:
				return Header{}, nil, t.peerGone(peer)
			}
		}
		if !l.hasHead {
			select {
			case l.head = <-l.ch:
				l.hasHead = true
			case <-ctx.Done():
				return Header{}, nil, ctx.Err()
			case <-t.done:
			case <-src.done:
			}
			continue
		}
		if cut, changed := t.n.blocked(peer, t.rank); cut {
			if src.closed() { // its frames cannot arrive before it is gone
				return Header{}, nil, t.peerGone(peer)
			}
			select {
			case <-changed:
			case <-ctx.Done():
				return Header{}, nil, ctx.Err()
			case <-t.done:
			case <-src.done:
			}
			continue
		}
		if wait := l.wait(); wait > 0 {
			if l.timer == nil {
				l.timer = time.NewTimer(wait)
			} else {
				l.timer.Reset(wait)
			}
			_, changed := t.n.blocked(peer, t.rank)
			select {
			case <-l.timer.C:
			case <-changed:
			case <-ctx.Done():
				l.timer.Stop()
				return Header{}, nil, ctx.Err()
			case <-t.done:
			case <-src.dead:
			}
			l.timer.Stop()
			continue
		}
		f := l.head
		l.head, l.hasHead = inprocFrame{}, false
		n := len(f.p)
		if n > len(buf) {
			l.recycle(f.p)
			return Header{}, nil, &PeerError{Rank: peer, Addr: inprocAddr(peer),
				Err: fmt.Errorf("%w: frame of %d bytes, receive buffer holds %d", ErrProtocol, n, len(buf))}
		}
		copy(buf, f.p)
		l.recycle(f.p)
		return f.h, buf[:n], nil
	}
}

// wait is how long the head frame must still wait for its delay.
func (l *inprocLink) wait() time.Duration {
	if l.head.due.IsZero() {
		return 0
	}
	return time.Until(l.head.due)
}

// recycle returns a payload buffer to its link's pool.
func (l *inprocLink) recycle(b []byte) {
	if cap(b) == 0 {
		return
	}
	select {
	case l.pool <- b:
	default:
	}
}
