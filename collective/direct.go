package collective

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// The direct path: a float collective whose buffer lies in the transport's shared arena
// (SharedMemory) on every rank runs without frames. The ranks publish progress records
// (Posted) and wait for one another's (Await: spin, then futex); in between, each rank reads
// its peers' buffers where they lie:
//
//   - AllReduce: enter; reduce shard r of EvenShards into the own buffer in fp32, reading
//     the peers' shard r where it lies, finalise it (Avg, rounding to the wire) and write it
//     into every peer's buffer, block by block; exit.
//   - ReduceScatter: enter; reduce and finalise shard r; exit.
//   - AllGather: round the own shard to the wire; enter; copy the peers' shards; exit.
//   - Broadcast: the root rounds its buffer; enter; the others copy it; exit.
//
// The exit step keeps a rank from returning (and its caller from overwriting its buffer)
// while a peer may still read it (or write it). Per byte of an N-rank all-reduce a rank
// reads its buffer's size once and writes it once (its own shard, and its shard into N-1
// buffers), against the ring's copy into the peer's ring, the reduction out of it and the
// same again for the all-gather; every rank ends with identical bits, since each shard is
// computed once and copied. A 16-bit wire is only a rounding here: there is no wire.
//
// Every rank must make the same calls on registered buffers, in the same order (the steps
// count them), and one at a time: the Ring runs its direct calls one after another, and a
// rank whose peer is in another call fails it with ErrProtocol. A rank whose buffer is
// registered while a peer's is not cannot tell: both wait, and fail by Config.Timeout. A
// failed direct call posts an abort: its peers fail at once, and from then on every direct
// call on this Ring fails (the ranks' steps are no longer in step); calls on other buffers
// still take the ring.

// directBlock is the elements reduced at a time: the running sum stays in L1 (16 KiB) while
// the peers' inputs stream through.
const directBlock = 4096

// directState is the Ring's direct path (r.dir), under its mutex.
type directState struct {
	mu    sync.Mutex
	step  uint64
	err   error // sticky: a direct call failed, the steps are out of step
	even  Shards
	views [][]float32
}

// AllocShared returns n zeroed float32s in this rank's shared arena, if its transport has
// one (SharedMemory): collectives on such buffers, registered on every rank, skip the ring
// (see direct.go). Calls on such buffers must be made one at a time, in the same order on
// every rank. The error wraps ErrNoShared where there is no arena or it is full; then
// allocate with make.
func (r *Ring) AllocShared(n int) ([]float32, error) {
	if r.shared == nil || r.size == 1 {
		return nil, fmt.Errorf("collective: rank %d of %d: %w", r.rank, r.size, ErrNoShared)
	}
	return r.shared.AllocShared(n)
}

// FreeShared returns a buffer AllocShared gave.
func (r *Ring) FreeShared(buf []float32) error {
	if r.shared == nil {
		return fmt.Errorf("collective: %w", ErrNoShared)
	}
	return r.shared.FreeShared(buf)
}

var _ SharedAllocator = (*Ring)(nil)

// directCallWord packs what every rank must agree on besides the tag, length and shards.
func directCallWord(op uint8, red Op, dt DType, root int) uint64 {
	return uint64(op)<<56 | uint64(red)<<48 | uint64(dt)<<40 | uint64(uint32(root))
}

// shardsHash is FNV-1a over the shard bounds.
func shardsHash(s Shards) uint64 {
	h := uint64(14695981039346656037)
	for _, v := range s {
		h ^= uint64(v)
		h *= 1099511628211
	}
	return h
}

// runDirect runs a validated float call on a buffer at byte offset off of this rank's
// arena. tag is the call's (already taken from the sequence for Tag 0).
func (r *Ring) runDirect(ctx context.Context, op uint8, buf elems, shards Shards, red Op, root int, tag uint64, off int64) error {
	d := &r.dir
	d.mu.Lock()
	defer d.mu.Unlock()
	name := callName(op, tag)
	if d.err != nil {
		return fmt.Errorf("collective %s on rank %d: an earlier call on shared buffers failed: %w", name, r.rank, d.err)
	}
	if err := r.shared.Hold(); err != nil {
		return fmt.Errorf("collective %s on rank %d: %w", name, r.rank, err)
	}
	defer r.shared.Unhold()
	n := buf.len()
	if op == OpAllReduce {
		if d.even == nil {
			d.even = make(Shards, r.size+1)
		}
		shards = evenShardsInto(d.even, n, r.size)
	}
	me := Posted{Tag: tag, Off: off, N: int64(n), Call: directCallWord(op, red, buf.dt, root), Shards: shardsHash(shards)}
	err := r.directCall(ctx, op, buf, shards, red, root, me)
	if err == nil {
		return nil
	}
	fault := r.rank
	var pe *PeerError
	if errors.As(err, &pe) {
		fault = pe.Rank
		if pe.Op == "" {
			err = &PeerError{Rank: pe.Rank, Addr: pe.Addr, Op: name, Err: pe.Err}
		}
	} else {
		err = fmt.Errorf("collective %s on rank %d: %w", name, r.rank, err)
	}
	d.err = err
	r.shared.Post(Posted{Step: d.step | PostedAbort, Fault: int64(fault)})
	return err
}

// sync posts the next step and waits for every peer to reach it.
func (r *Ring) sync(ctx context.Context, me *Posted) error {
	d := &r.dir
	d.step++
	me.Step = d.step
	r.shared.Post(*me)
	for i := 1; i < r.size; i++ {
		p := (r.rank + i) % r.size
		if err := r.shared.Await(ctx, p, d.step, r.cfg.Timeout); err != nil {
			return err
		}
	}
	return nil
}

// directCall is runDirect's work, under r.dir.mu.
func (r *Ring) directCall(ctx context.Context, op uint8, buf elems, shards Shards, red Op, root int, me Posted) error {
	if err := ctx.Err(); err != nil {
		return ctxErr(ctx)
	}
	d := &r.dir
	own := buf.f
	wire := buf.wire()
	switch op {
	case OpAllGather:
		vec.Round(own[shards[r.rank]:shards[r.rank+1]], wire)
	case OpBroadcast:
		if r.rank == root {
			vec.Round(own, wire)
		}
	}
	if err := r.sync(ctx, &me); err != nil {
		return err
	}
	// Every peer has entered: check that it makes this call, and map its buffer.
	if len(d.views) != r.size {
		d.views = make([][]float32, r.size)
	}
	for p := range r.size {
		if p == r.rank {
			d.views[p] = own
			continue
		}
		pp := r.shared.Posted(p)
		if pp.Tag != me.Tag || pp.N != me.N || pp.Call != me.Call || pp.Shards != me.Shards {
			return &PeerError{Rank: p, Addr: r.t.Addr(p), Err: fmt.Errorf("%w: rank %d is in another call on shared buffers (%s of %d elements)",
				ErrProtocol, p, callName(uint8(pp.Call>>56), pp.Tag), pp.N)}
		}
		v, err := r.shared.PeerShared(p, pp.Off, len(own))
		if err != nil {
			return &PeerError{Rank: p, Addr: r.t.Addr(p), Err: err}
		}
		d.views[p] = v
	}
	views := d.views
	var lo, hi int // the own shard (none for a broadcast)
	if shards != nil {
		lo, hi = shards[r.rank], shards[r.rank+1]
	}
	var recv, sent int
	switch op {
	case OpAllReduce, OpReduceScatter:
		r.reduceShard(views, lo, hi, red, wire, op == OpAllReduce)
		recv, sent = (r.size-1)*(hi-lo), shards[r.size]-(hi-lo)
		if op == OpAllReduce { // the all-gather's share, pushed by the owners
			recv, sent = recv+shards[r.size]-(hi-lo), sent+(r.size-1)*(hi-lo)
		}
	case OpAllGather:
		r.gather(views, own, shards)
		recv, sent = shards[r.size]-(hi-lo), (r.size-1)*(hi-lo)
	case OpBroadcast:
		if r.rank != root {
			copy(own, views[root])
			recv = len(own)
		} else {
			sent = (r.size - 1) * len(own)
		}
	}
	clear(d.views)
	if err := r.sync(ctx, &me); err != nil {
		return err
	}
	if r.counts != nil {
		// What was read from the peers' memory, and what they read from this rank's: the
		// bytes a frame would have carried.
		r.counts.recv[opIndex(op)].Add(uint64(4 * recv))
		r.counts.sent[opIndex(op)].Add(uint64(4 * sent))
	}
	return nil
}

// reduceShard reduces views[0..N-1][lo:hi] into own = views[r] and finalises it, block by
// block; with push it then writes each finished block into every peer's buffer too (the
// all-reduce's all-gather, done by the shard's owner: no pass of its own, no third sync).
// Nothing races: shard r of every buffer is only ever read or written by rank r. The order
// is the owner's own value first, then its successors' in ring order: any fixed order gives
// identical bits on every rank, since each shard is computed by its owner alone; this one
// accumulates in place, so the block stays in cache while the peers' stream through.
func (r *Ring) reduceShard(views [][]float32, lo, hi int, red Op, wire half.Format, push bool) {
	own := views[r.rank]
	for j := lo; j < hi; j += directBlock {
		e := min(j+directBlock, hi)
		acc := own[j:e]
		for i := 1; i < r.size; i++ {
			src := views[(r.rank+i)%r.size][j:e]
			switch red {
			case Max:
				vec.Max(acc, src)
			case Min:
				for k, v := range src {
					acc[k] = min(acc[k], v)
				}
			default:
				vec.Add(acc, src)
			}
		}
		finalizeFloats(acc, red, r.size, wire)
		if push {
			for i := 1; i < r.size; i++ {
				copy(views[(r.rank+i)%r.size][j:e], acc)
			}
		}
	}
}

// gather copies every peer's shard out of its buffer, starting with the successor's so that
// the ranks read from different peers at once.
func (r *Ring) gather(views [][]float32, own []float32, shards Shards) {
	for i := 1; i < r.size; i++ {
		p := (r.rank + i) % r.size
		copy(own[shards[p]:shards[p+1]], views[p][shards[p]:shards[p+1]])
	}
}
