package collective

// The ring schedules, as pure arithmetic: which region of the buffer a rank sends to its
// successor and receives from its predecessor at each step, and how those regions are cut
// into pieces on the wire. Ring.go runs them; schedule_test.go checks them by table.
//
// Reduce-scatter (Patarasuk & Yuan 2009, section 3; NCCL's ring): in N-1 steps, at step k
// rank r sends shard (r-k-1) mod N and receives shard (r-k-2) mod N, adding the received
// values into its own copy. The shard a rank receives at step k is the one it sends at step
// k+1, so every shard travels round the ring collecting one contribution per rank, and after
// step N-2 rank r holds the full reduction of shard r.
//
// All-gather: in N-1 steps, at step j rank r sends shard (r-j) mod N (its own at j = 0) and
// receives shard (r-j-1) mod N, which it forwards at step j+1.
//
// All-reduce is the two back to back with one step numbering (reduce-scatter 0..N-2,
// all-gather N-1..2N-3): the last shard a rank receives in the reduce-scatter is its own, and
// it is exactly what it sends first in the all-gather, so the invariant above — received at
// step g, sent at step g+1 — holds across the whole call. Each rank sends 2(N-1)/N of the
// buffer, which is optimal for a ring.
//
// Broadcast is a pipelined chain root → root+1 → ... → root-1: the rank at distance d from
// root receives step d-1 and forwards it as step d.
//
// Every step carries at least one frame, even for an empty region, so that a rank whose
// lengths or shards differ from its neighbour's is caught by the frame checks, and so that
// Barrier (a reduce-scatter of nothing) still passes a token round the ring.

// span is the region [lo, hi) of the buffer that one ring step moves, with its step number.
type span struct {
	lo, hi int
	step   uint32
}

// pieces is the number of frames a span of n elements takes with chunk elements per frame;
// at least one.
func pieces(n, chunk int) int {
	if n <= chunk {
		return 1
	}
	return (n + chunk - 1) / chunk
}

// pieceBounds returns the region of piece p of sp.
func pieceBounds(sp span, p, chunk int) (lo, hi int) {
	lo = sp.lo + p*chunk
	return lo, min(sp.hi, lo+chunk)
}

// spanFrames is the number of frames of a list of spans.
func spanFrames(s []span, chunk int) int {
	n := 0
	for _, sp := range s {
		n += pieces(sp.hi-sp.lo, chunk)
	}
	return n
}

// schedule is what one rank sends and receives in one call, in wire order. Frame i of the
// received sequence, once applied, makes frame initial+i of the sent sequence ready (the
// regions are the same: that is the pipelining rule "piece p of step k+1 leaves as soon as
// piece p of step k has arrived and been reduced").
type schedule struct {
	send, recv []span
	chunk      int // elements per piece
	// initial is the number of send frames ready at the start: all of send[0] when this rank
	// starts the ring, none for a broadcast rank that only forwards.
	initial int
	// reduceSteps: recv spans [0, reduceSteps) are reduced into the buffer, later ones copied.
	reduceSteps int
	// finalStep is the recv span after which the received piece is final on this rank (the
	// last reduce-scatter step: divide for Avg, round to the wire format); -1 if none.
	finalStep int
	// gateStep, gateFrames: before applying a frame of recv span gateStep or later, at least
	// gateFrames frames must have been sent. In an all-reduce the all-gather overwrites
	// shards whose reduce-scatter pieces this rank sent earlier; an honest predecessor cannot
	// get ahead of them, but a faulty one could, and the sender must never read a region while
	// it is being written. -1 if none.
	gateStep, gateFrames int
}

// mod is the non-negative remainder, for ring arithmetic on ranks.
func mod(x, n int) int {
	x %= n
	if x < 0 {
		x += n
	}
	return x
}

// plan fills s for collective op (OpAllReduce ... OpBarrier) on rank of size ranks (size
// >= 2), reusing s's slices. shards partitions the buffer (for OpAllReduce and OpBarrier the
// caller passes EvenShards of the length); n is the buffer length (for OpBroadcast);
// root is the broadcast root.
func (s *schedule) plan(op uint8, rank, size int, shards Shards, n, root, chunk int) {
	s.send, s.recv = s.send[:0], s.recv[:0]
	s.chunk = chunk
	s.reduceSteps, s.finalStep, s.gateStep, s.gateFrames = 0, -1, -1, 0
	shard := func(i int) (int, int) { i = mod(i, size); return shards[i], shards[i+1] }
	add := func(dst []span, lo, hi, step int) []span {
		return append(dst, span{lo: lo, hi: hi, step: uint32(step)})
	}
	switch op {
	case OpAllReduce, OpReduceScatter, OpBarrier:
		for k := 0; k < size-1; k++ {
			lo, hi := shard(rank - k - 1)
			s.send = add(s.send, lo, hi, k)
			lo, hi = shard(rank - k - 2)
			s.recv = add(s.recv, lo, hi, k)
		}
		s.reduceSteps, s.finalStep = size-1, size-2
		if op == OpAllReduce {
			s.gateStep, s.gateFrames = size-1, spanFrames(s.send, chunk)
			for j := 0; j < size-1; j++ {
				lo, hi := shard(rank - j)
				s.send = add(s.send, lo, hi, size-1+j)
				lo, hi = shard(rank - j - 1)
				s.recv = add(s.recv, lo, hi, size-1+j)
			}
		}
	case OpAllGather:
		for j := 0; j < size-1; j++ {
			lo, hi := shard(rank - j)
			s.send = add(s.send, lo, hi, j)
			lo, hi = shard(rank - j - 1)
			s.recv = add(s.recv, lo, hi, j)
		}
	case OpBroadcast:
		d := mod(rank-root, size)
		if d > 0 {
			s.recv = add(s.recv, 0, n, d-1)
		}
		if d < size-1 {
			s.send = add(s.send, 0, n, d)
		}
	}
	s.initial = 0
	if len(s.send) > 0 && (op != OpBroadcast || rank == root) {
		s.initial = pieces(s.send[0].hi-s.send[0].lo, chunk)
	}
}

// planShift fills s for a shift (Ring.Shift): one step, in which a rank sends its nsend
// elements to its successor and receives nrecv from its predecessor, each at offset 0 of its
// own buffer, copied.
func (s *schedule) planShift(nsend, nrecv, chunk int) {
	s.send = append(s.send[:0], span{lo: 0, hi: nsend})
	s.recv = append(s.recv[:0], span{lo: 0, hi: nrecv})
	s.chunk = chunk
	s.reduceSteps, s.finalStep, s.gateStep, s.gateFrames = 0, -1, -1, 0
	s.initial = pieces(nsend, chunk)
}

// evenShardsInto is EvenShards written into dst (len size+1) so a call does not allocate.
func evenShardsInto(dst Shards, n, size int) Shards {
	dst = dst[:size+1]
	dst[0] = 0
	q, r := n/size, n%size
	for i := 0; i < size; i++ {
		dst[i+1] = dst[i] + q
		if i < r {
			dst[i+1]++
		}
	}
	return dst
}
