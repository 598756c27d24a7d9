package collective

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// Hierarchical is a Communicator over a world of H hosts × L ranks, built from two smaller
// ones: a local group (the L ranks of this host, over shared memory) and a cross group (the
// H ranks with this rank's local rank, one per host, over TCP). There are L cross groups,
// and they run in parallel, so every rank's TCP link carries 1/L of the host's cross-host
// traffic — the two-level scheme of Horovod's hierarchical all-reduce (reduce-scatter
// within a node, all-reduce across, all-gather within). Global rank and size are the
// Topology's.
//
// Each collective is a short series of steps on the two groups:
//
//   - AllReduce: local reduce-scatter over EvenShards(n, L) → cross all-reduce of this
//     rank's local shard → local all-gather. No copies.
//   - ReduceScatter and AllGather with arbitrary global shards: see (*Hierarchical).layout.
//     The global shards of the ranks with local rank l are scattered over the buffer, so they
//     are packed into a staging buffer where they are contiguous, costing one copy of the
//     buffer (n elements) plus the own shard, unless the ranks are dealt to hosts round
//     robin, which makes the staging layout the buffer's own (then no copies).
//   - Broadcast and BroadcastBytes: cross broadcast among the ranks with the root's local
//     rank → local broadcast on every host from that local rank.
//   - AllReduceInt64: local all-reduce → cross all-reduce (every cross group the same).
//   - Barrier: local barrier, then cross barrier. The cross barrier returning on a rank
//     means every rank with its local rank has passed its local barrier, which means every
//     rank of every host has entered, so a third (local) barrier adds nothing.
//
// Results. Max, Min, the int64 reductions and every copy are exact. Sum and Avg add in a different order from a flat
// ring: each host's partial sums first, then across hosts. With integer-valued fp32 inputs
// whose sums are exact (the conformance suite's) the results are the flat ring's bits;
// otherwise fp32 sums differ from the flat ring's by at most 2(N-1)·2⁻²⁴·Σ|x| (both are
// within (N-1)·2⁻²⁴·Σ|x| of the exact sum; TestHierarchicalVsFlat checks it). On a 16-bit
// wire a value is rounded at most L+H times on its way (L-1 local sends, the local owner,
// H-1 cross sends, the cross owner), against N for a flat ring, and L+H ≤ N+1. Avg is a Sum
// throughout, divided once by N at the end (like the flat ring's, so with fp32 it is the
// correctly rounded quotient of the same sum), then rounded to the wire once more; on fp16
// the sum itself must therefore fit fp16's range. Every rank ends bit-identical: each
// element's final value is computed on one rank (its cross group's owner, identical across
// the cross group by the ring's guarantee) and copied to the rest by the all-gather.
//
// Tags. Call.Tag is passed to both groups unchanged: each is its own set of rings, so
// concurrent calls stay apart by their tags in each. AllReduce, ReduceScatter and
// AllGather use the local group twice or use it and the cross group one after the other
// under the same tag, which the Ring allows (a tag is free again once its call returns; its
// early frames for the next call wait for it). Untagged calls use each group's sequence;
// every rank makes the same steps in the same order, so the sequences stay aligned.
//
// Failure. An error names the global rank at fault: a *PeerError from a group names a rank
// of that group, which is mapped to its global rank (Topology.Local or Cross). A failure must
// also reach ranks that are waiting in the other group: a rank whose step fails still makes
// its remaining steps, with a context already cancelled, so its groups' rings abort those
// calls on the peers at once instead of leaving them to time out. The cancellation's cause
// carries the global rank at fault in its text (hierFault), since an abort frame can only
// name a rank of its own group and carries the rest as text; a rank receiving such an abort
// names that global rank. The caller's context must not be cancelled with a cause that is a
// *PeerError naming a global rank: a group's Ring would read that rank as one of its own.
//
// Sub-communicators whose size is 1 make the other one the whole world (one host, or one
// rank per host): then every call goes straight to it.
//
// All methods are safe for concurrent use. Hierarchical owns the two communicators: Close
// closes them.
type Hierarchical struct {
	local, cross Communicator
	topo         Topology
	rank, size   int
	nl, nh       int // ranks per host, hosts
	myHost       int
	myLocal      int
	// flat is the communicator that spans the world when the other is a group of one.
	flat Communicator
	// grid[h*nl+l] is the global rank of local rank l on host h; localOf[g] is rank g's
	// local rank.
	grid    []int
	localOf []int
	// identity: the staging layout of layout is the buffer's own, so ReduceScatter and
	// AllGather work in place.
	identity bool

	stageBytes atomic.Int64 // capacity of the staging buffers held, in bytes
	mu         struct {
		sync.Mutex
		free []*hierScratch // idle per-call scratch, reused so a call allocates nothing
	}
	once     sync.Once
	closeErr error
}

var _ Communicator = (*Hierarchical)(nil)

// maxIdleScratch bounds the idle staging buffers kept for reuse: one per call that may run
// concurrently in practice (ZeRO overlaps a few buckets).
const maxIdleScratch = 8

// hierScratch is one call's working state.
type hierScratch struct {
	even  Shards    // EvenShards of the world, when a call's own shards are invalid
	local Shards    // the local group's shards of the staging buffer
	cross Shards    // the cross group's shards of this rank's local segment
	off   []int     // off[g]: where global rank g's shard starts in the staging buffer
	stage []float32 // the staging buffer (grown on demand)
}

// NewHierarchical returns the hierarchical Communicator for topo's rank, from the local
// group's communicator (ranks topo.Local, this rank at topo.LocalRank) and the cross group's
// (ranks topo.Cross, at topo.CrossRank). topo must be Uniform. It takes ownership of both.
func NewHierarchical(local, cross Communicator, topo Topology) (*Hierarchical, error) {
	switch {
	case topo.Rank < 0 || topo.Rank >= topo.Size:
		return nil, fmt.Errorf("collective: hierarchical: rank %d outside a world of %d", topo.Rank, topo.Size)
	case !topo.Uniform:
		return nil, fmt.Errorf("collective: hierarchical communicator needs the same number of ranks on every host (%s)", topo.describe())
	case local.Size() != len(topo.Local) || local.Rank() != topo.LocalRank:
		return nil, fmt.Errorf("collective: hierarchical: local communicator is rank %d of %d, topology says %d of %d",
			local.Rank(), local.Size(), topo.LocalRank, len(topo.Local))
	case cross.Size() != len(topo.Cross) || cross.Rank() != topo.CrossRank:
		return nil, fmt.Errorf("collective: hierarchical: cross communicator is rank %d of %d, topology says %d of %d",
			cross.Rank(), cross.Size(), topo.CrossRank, len(topo.Cross))
	case len(topo.Local)*len(topo.Cross) != topo.Size || len(topo.HostOf) != topo.Size || len(topo.Hosts) != len(topo.Cross):
		return nil, fmt.Errorf("collective: hierarchical: inconsistent topology (%d local × %d cross ranks for a world of %d)",
			len(topo.Local), len(topo.Cross), topo.Size)
	}
	h := &Hierarchical{
		local: local, cross: cross, topo: topo,
		rank: topo.Rank, size: topo.Size,
		nl: len(topo.Local), nh: len(topo.Cross),
		myHost: topo.HostOf[topo.Rank], myLocal: topo.LocalRank,
		grid: make([]int, topo.Size), localOf: make([]int, topo.Size),
	}
	if h.myHost != topo.CrossRank {
		return nil, fmt.Errorf("collective: hierarchical: rank %d is on host %d but at cross rank %d", h.rank, h.myHost, topo.CrossRank)
	}
	h.identity = true
	for c, m := range topo.members() {
		for l, g := range m {
			h.grid[c*h.nl+l] = g
			h.localOf[g] = l
			if g != l*h.nh+c {
				h.identity = false
			}
		}
	}
	switch {
	case h.nh == 1:
		h.flat = local
	case h.nl == 1:
		h.flat = cross
	}
	return h, nil
}

// Rank is the global rank.
func (h *Hierarchical) Rank() int { return h.rank }

// Size is the world size.
func (h *Hierarchical) Size() int { return h.size }

// Topology returns the topology the communicator was built for.
func (h *Hierarchical) Topology() Topology { return h.topo }

// BufferBytes reports the receive and staging buffers held, for memory accounting: the two
// communicators' (where they report it) and the staging buffers of ReduceScatter and
// AllGather, up to maxIdleScratch+concurrent calls times the largest buffer.
func (h *Hierarchical) BufferBytes() int64 {
	b := h.stageBytes.Load()
	for _, c := range []Communicator{h.local, h.cross} {
		if bb, ok := c.(interface{ BufferBytes() int64 }); ok {
			b += bb.BufferBytes()
		}
	}
	return b
}

// AllocShared allocates through the local communicator (collective.SharedAllocator): the
// local reduce-scatter and all-gather of an AllReduce on such a buffer read the host's peers'
// buffers in place (the cross all-reduce sends from it as from any buffer). ReduceScatter and
// AllGather stage through heap buffers unless the layout is the identity, and so gain only
// then.
func (h *Hierarchical) AllocShared(n int) ([]float32, error) {
	if a, ok := h.local.(SharedAllocator); ok {
		return a.AllocShared(n)
	}
	return nil, fmt.Errorf("collective: hierarchical rank %d: %w", h.rank, ErrNoShared)
}

// FreeShared returns a buffer AllocShared gave.
func (h *Hierarchical) FreeShared(buf []float32) error {
	if a, ok := h.local.(SharedAllocator); ok {
		return a.FreeShared(buf)
	}
	return fmt.Errorf("collective: hierarchical rank %d: %w", h.rank, ErrNoShared)
}

var _ SharedAllocator = (*Hierarchical)(nil)

// Close closes both communicators. Safe to call more than once.
func (h *Hierarchical) Close() error {
	h.once.Do(func() { h.closeErr = errors.Join(h.local.Close(), h.cross.Close()) })
	return h.closeErr
}

// AllReduce: local reduce-scatter, cross all-reduce of the local shard, local all-gather.
func (h *Hierarchical) AllReduce(ctx context.Context, buf []float32, op Op, c Call) error {
	if h.flat != nil {
		return h.flat.AllReduce(ctx, buf, op, c)
	}
	ch := h.begin(ctx, OpAllReduce, c.Tag)
	sc := h.getScratch(0)
	defer h.putScratch(sc)
	ls := evenShardsInto(sc.local, len(buf), h.nl)
	sub := sumFor(op)
	ch.note(groupLocal, h.local.ReduceScatter(ch.ctx, buf, ls, sub, c))
	seg := buf[ls[h.myLocal]:ls[h.myLocal+1]]
	ch.note(groupCross, h.cross.AllReduce(ch.ctx, seg, sub, c))
	if op == Avg && ch.err == nil {
		h.average(seg, c.Wire)
	}
	ch.note(groupLocal, h.local.AllGather(ch.ctx, buf, ls, c))
	return ch.err
}

// ReduceScatter: pack (see layout), local reduce-scatter of the staging buffer, cross
// reduce-scatter of this rank's local segment, unpack this rank's shard.
func (h *Hierarchical) ReduceScatter(ctx context.Context, buf []float32, shards Shards, op Op, c Call) error {
	if h.flat != nil {
		return h.flat.ReduceScatter(ctx, buf, shards, op, c)
	}
	ch := h.begin(ctx, OpReduceScatter, c.Tag)
	sc := h.getScratch(len(buf))
	defer h.putScratch(sc)
	shards = ch.shards(shards, len(buf), sc)
	stage := h.layout(sc, shards, buf)
	if !h.identity {
		for g := range h.size {
			copy(stage[sc.off[g]:], buf[shards[g]:shards[g+1]])
		}
	}
	sub := sumFor(op)
	ch.note(groupLocal, h.local.ReduceScatter(ch.ctx, stage, sc.local, sub, c))
	seg := stage[sc.local[h.myLocal]:sc.local[h.myLocal+1]]
	ch.note(groupCross, h.cross.ReduceScatter(ch.ctx, seg, sc.cross, sub, c))
	if ch.err != nil {
		return ch.err
	}
	lo, hi := shards[h.rank], shards[h.rank+1]
	mine := stage[sc.off[h.rank] : sc.off[h.rank]+hi-lo]
	if op == Avg {
		h.average(mine, c.Wire)
	}
	if !h.identity {
		copy(buf[lo:hi], mine)
	}
	return nil
}

// AllGather: place this rank's shard in the staging buffer (see layout), cross all-gather of
// this rank's local segment, local all-gather of the staging buffer, unpack all of it.
func (h *Hierarchical) AllGather(ctx context.Context, buf []float32, shards Shards, c Call) error {
	if h.flat != nil {
		return h.flat.AllGather(ctx, buf, shards, c)
	}
	ch := h.begin(ctx, OpAllGather, c.Tag)
	sc := h.getScratch(len(buf))
	defer h.putScratch(sc)
	shards = ch.shards(shards, len(buf), sc)
	stage := h.layout(sc, shards, buf)
	if !h.identity {
		copy(stage[sc.off[h.rank]:], buf[shards[h.rank]:shards[h.rank+1]])
	}
	seg := stage[sc.local[h.myLocal]:sc.local[h.myLocal+1]]
	ch.note(groupCross, h.cross.AllGather(ch.ctx, seg, sc.cross, c))
	ch.note(groupLocal, h.local.AllGather(ch.ctx, stage, sc.local, c))
	if ch.err != nil {
		return ch.err
	}
	if !h.identity {
		// Every shard, this rank's too: the gather rounded it to the wire format.
		for g := range h.size {
			copy(buf[shards[g]:shards[g+1]], stage[sc.off[g]:])
		}
	}
	return nil
}

// Broadcast: the root's cross group first, then every host from its rank with the root's
// local rank.
func (h *Hierarchical) Broadcast(ctx context.Context, buf []float32, root int, c Call) error {
	if h.flat != nil {
		return h.flat.Broadcast(ctx, buf, root, c)
	}
	ch := h.begin(ctx, OpBroadcast, c.Tag)
	if root < 0 || root >= h.size {
		ch.fail(fmt.Errorf("broadcast root %d outside a group of %d", root, h.size))
		root = 0 // the steps still run, cancelled, to abort them on the peers
	}
	rootHost, rootLocal := h.topo.HostOf[root], h.localOf[root]
	if h.myLocal == rootLocal {
		ch.note(groupCross, h.cross.Broadcast(ch.ctx, buf, rootHost, c))
	}
	ch.note(groupLocal, h.local.Broadcast(ch.ctx, buf, rootLocal, c))
	return ch.err
}

// AllReduceInt64: local all-reduce, then cross all-reduce of the host's result. Every cross
// group reduces the same values (each rank of a host holds its host's result), so the L
// cross groups do the same work in parallel; for the small messages this call carries
// (counters, flags) that costs less than a reduce-scatter's extra steps. Exact, like the
// groups' own.
func (h *Hierarchical) AllReduceInt64(ctx context.Context, v []int64, op Op) error {
	if h.flat != nil {
		return h.flat.AllReduceInt64(ctx, v, op)
	}
	ch := h.begin(ctx, OpAllReduce, 0)
	ch.note(groupLocal, h.local.AllReduceInt64(ch.ctx, v, op))
	ch.note(groupCross, h.cross.AllReduceInt64(ch.ctx, v, op))
	return ch.err
}

// BroadcastBytes: as Broadcast, the root's cross group first, then every host from its
// rank with the root's local rank.
func (h *Hierarchical) BroadcastBytes(ctx context.Context, b []byte, root int) error {
	if h.flat != nil {
		return h.flat.BroadcastBytes(ctx, b, root)
	}
	ch := h.begin(ctx, OpBroadcast, 0)
	if root < 0 || root >= h.size {
		ch.fail(fmt.Errorf("broadcast root %d outside a group of %d", root, h.size))
		root = 0 // the steps still run, cancelled, to abort them on the peers
	}
	rootHost, rootLocal := h.topo.HostOf[root], h.localOf[root]
	if h.myLocal == rootLocal {
		ch.note(groupCross, h.cross.BroadcastBytes(ch.ctx, b, rootHost))
	}
	ch.note(groupLocal, h.local.BroadcastBytes(ch.ctx, b, rootLocal))
	return ch.err
}

// Barrier: local, then cross (see the type's comment for why two suffice).
func (h *Hierarchical) Barrier(ctx context.Context) error {
	if h.flat != nil {
		return h.flat.Barrier(ctx)
	}
	ch := h.begin(ctx, OpBarrier, 0)
	ch.note(groupLocal, h.local.Barrier(ch.ctx))
	ch.note(groupCross, h.cross.Barrier(ch.ctx))
	return ch.err
}

// layout plans the staging buffer of a ReduceScatter or AllGather and returns it: buf
// itself when h.identity, else a scratch buffer of buf's length. Global rank g = (host c, local
// rank l) owns shards[g]. In the staging buffer the shards are ordered by local rank, then
// by host:
//
//	[ (0,0) (1,0) … (H-1,0) | (0,1) (1,1) … (H-1,1) | … | (0,L-1) … (H-1,L-1) ]
//	  local segment 0          local segment 1              local segment L-1
//
// so local rank l's segment (sc.local) is exactly what its cross group reduces or gathers,
// and within it host c's piece (sc.cross) is the shard of the cross group's rank c. A
// reduce-scatter thus costs a copy of the whole buffer in (the pack) and of the own shard
// out; an all-gather the own shard in and the whole buffer out. When ranks are dealt to
// hosts round robin (rank g on host g mod H) the order is the buffer's own and nothing is
// copied.
func (h *Hierarchical) layout(sc *hierScratch, shards Shards, buf []float32) []float32 {
	pos := 0
	for l := range h.nl {
		sc.local[l] = pos
		for c := range h.nh {
			g := h.grid[c*h.nl+l]
			if l == h.myLocal {
				sc.cross[c] = pos - sc.local[l]
			}
			sc.off[g] = pos
			pos += shards[g+1] - shards[g]
		}
		if l == h.myLocal {
			sc.cross[h.nh] = pos - sc.local[l]
		}
	}
	sc.local[h.nl] = pos
	if h.identity {
		return buf
	}
	return sc.stage[:len(buf)]
}

// average turns a fully reduced sum into the average, as the Ring's finalize does (a
// power of two's reciprocal is exact; otherwise a true division), rounded to the wire.
func (h *Hierarchical) average(x []float32, wire half.Format) {
	if n := h.size; n&(n-1) == 0 {
		vec.Scale(x, 1/float32(n))
	} else {
		d := float32(n)
		for i := range x {
			x[i] /= d
		}
	}
	vec.Round(x, wire)
}

// sumFor is the reduction the groups run for op: Avg is a Sum until the end.
func sumFor(op Op) Op {
	if op == Avg {
		return Sum
	}
	return op
}

// getScratch takes a call's scratch, its staging buffer at least n long.
func (h *Hierarchical) getScratch(n int) *hierScratch {
	h.mu.Lock()
	var sc *hierScratch
	if k := len(h.mu.free); k > 0 {
		sc = h.mu.free[k-1]
		h.mu.free[k-1] = nil
		h.mu.free = h.mu.free[:k-1]
	}
	h.mu.Unlock()
	if sc == nil {
		sc = &hierScratch{
			even: make(Shards, h.size+1), local: make(Shards, h.nl+1),
			cross: make(Shards, h.nh+1), off: make([]int, h.size),
		}
	}
	if n > 0 && !h.identity && cap(sc.stage) < n {
		h.stageBytes.Add(4 * int64(n-cap(sc.stage)))
		sc.stage = make([]float32, n)
	}
	return sc
}

// putScratch returns a call's scratch for reuse, or drops it beyond maxIdleScratch.
func (h *Hierarchical) putScratch(sc *hierScratch) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(h.mu.free) < maxIdleScratch {
		h.mu.free = append(h.mu.free, sc)
		return
	}
	h.stageBytes.Add(-4 * int64(cap(sc.stage)))
}

// hierGroup names the group a step ran in.
type hierGroup uint8

const (
	groupLocal hierGroup = iota
	groupCross
)

func (g hierGroup) String() string {
	if g == groupLocal {
		return "local"
	}
	return "cross-host"
}

// hierChain runs the steps of one call. After the first failure, later steps still run,
// with a context cancelled with a hierFault naming the global rank at fault, so that the
// groups' rings abort the calls that peers in other groups are waiting in.
type hierChain struct {
	h   *Hierarchical
	op  uint8
	tag uint64
	ctx context.Context
	err error // the first failure, naming a global rank
}

func (h *Hierarchical) begin(ctx context.Context, op uint8, tag uint64) hierChain {
	return hierChain{h: h, op: op, tag: tag, ctx: ctx}
}

// note records a step's result.
func (ch *hierChain) note(g hierGroup, err error) {
	if err == nil || ch.err != nil {
		return
	}
	ch.err, ch.ctx = ch.h.blame(ch.op, ch.tag, g, err)
}

// fail records a failure of this rank's own making (a bad argument).
func (ch *hierChain) fail(err error) {
	if ch.err != nil {
		return
	}
	ch.err = fmt.Errorf("collective %s on rank %d: %w", hierName(ch.op, ch.tag), ch.h.rank, err)
	ch.ctx = relayContext(ch.h.rank, ch.err)
}

// shards validates a call's shards; invalid ones fail the call, whose steps then run over
// even shards (cancelled) only to abort them on the peers.
func (ch *hierChain) shards(s Shards, n int, sc *hierScratch) Shards {
	if err := s.Validate(n, ch.h.size); err != nil {
		ch.fail(err)
		return evenShardsInto(sc.even, n, ch.h.size)
	}
	return s
}

// hierName names a call for errors: "hierarchical all-reduce (tag 7)".
func hierName(op uint8, tag uint64) string {
	if tag == 0 {
		return "hierarchical " + opName(op)
	}
	return fmt.Sprintf("hierarchical %s (tag %d)", opName(op), tag)
}

// hierFaultMarker introduces the global rank at fault in a hierFault's text.
const hierFaultMarker = "[hierarchical: fault at global rank "

// hierFault is the cause a failed call's remaining steps are cancelled with. The Ring sends
// the cause's text in its abort frames; the receiving Hierarchical reads the rank back
// (relayedFault). It deliberately does not unwrap to the *PeerError it describes: a Ring
// takes a *PeerError in its context's cause for one naming a rank of its own group.
type hierFault struct {
	rank int
	err  error
}

func (f *hierFault) Error() string {
	return hierFaultMarker + strconv.Itoa(f.rank) + "] " + f.err.Error()
}

// relayContext is an already cancelled context whose cause names the global rank at fault.
func relayContext(rank int, err error) context.Context {
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(&hierFault{rank: rank, err: err})
	return ctx
}

// relayedFault finds the global rank a hierFault named in an error's text.
func relayedFault(err error, size int) (int, bool) {
	s := err.Error()
	i := strings.Index(s, hierFaultMarker)
	if i < 0 {
		return 0, false
	}
	s = s[i+len(hierFaultMarker):]
	j := strings.IndexByte(s, ']')
	if j < 0 {
		return 0, false
	}
	r, perr := strconv.Atoi(s[:j])
	if perr != nil || r < 0 || r >= size {
		return 0, false
	}
	return r, true
}

// blame turns a group's error into the call's, naming the global rank at fault, and returns
// the context the call's remaining steps run with. A *PeerError (at the top of the error, as
// the Ring returns them) names a rank of the group, or carries a relayed hierFault naming a
// global rank; any other error is this rank's own (its context ended, it was closed, the
// arguments were wrong).
func (h *Hierarchical) blame(op uint8, tag uint64, g hierGroup, err error) (error, context.Context) {
	ranks := h.topo.Local
	if g == groupCross {
		ranks = h.topo.Cross
	}
	if pe, ok := err.(*PeerError); ok {
		rank, addr := -1, pe.Addr
		if r, ok := relayedFault(pe.Err, h.size); ok {
			rank, addr = r, "" // pe.Addr is the relaying rank's
		} else if pe.Rank >= 0 && pe.Rank < len(ranks) {
			rank = ranks[pe.Rank]
		}
		if rank >= 0 {
			mapped := &PeerError{Rank: rank, Addr: addr, Op: fmt.Sprintf("%s, %s %s", hierName(op, tag), g, pe.Op), Err: pe.Err}
			return mapped, relayContext(rank, mapped)
		}
	}
	wrapped := fmt.Errorf("collective %s on rank %d, %s group: %w", hierName(op, tag), h.rank, g, err)
	return wrapped, relayContext(h.rank, wrapped)
}
