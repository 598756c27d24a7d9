package collective

import (
	"context"
	"fmt"
)

// Shifter is a Communicator with a point-to-point step round the ring: every rank sends send
// to rank+1 mod N and receives rank-1's send into recv. The lengths may differ from rank to
// rank, but each rank's recv must be exactly as long as its predecessor's send. Like the
// collectives, it runs concurrently with other calls under a distinct explicit Call.Tag
// (elastic training ships each rank's ZeRO shard to its neighbour this way while the step's
// collectives go on), and it ends when ctx does.
type Shifter interface {
	Shift(ctx context.Context, send, recv []float32, c Call) error
}

var _ Shifter = (*Ring)(nil)

// Shift is one ring step of the Ring's own: each piece of send goes to the successor once
// (N× less traffic than any collective could do it with). In a group of one, recv gets a
// copy of send.
func (r *Ring) Shift(ctx context.Context, send, recv []float32, c Call) error {
	if r.size == 1 {
		if len(send) != len(recv) {
			return fmt.Errorf("collective shift on rank 0: sending %d elements to itself into %d", len(send), len(recv))
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		copy(recv, send)
		return nil
	}
	return r.runFrom(ctx, OpShift, floatElems(recv, c.Wire), floatElems(send, c.Wire), nil, Sum, 0, c)
}

// Shift runs comm's Shift where comm is a Shifter, else shiftByGather: the same result, over
// AllGather, for any Communicator.
func Shift(ctx context.Context, comm Communicator, send, recv []float32, c Call) error {
	if s, ok := comm.(Shifter); ok {
		return s.Shift(ctx, send, recv, c)
	}
	return shiftByGather(ctx, comm, send, recv, c)
}

// gatherChunk bounds the elements each rank contributes to one round of shiftByGather, so
// its scratch stays at gatherChunk × N floats whatever the buffers' sizes.
const gatherChunk = 1 << 18

// shiftByGather is Shift for a Communicator without one: an all-gather of every rank's
// length (each split in two exact float32 halves), then rounds of all-gathers of up to
// gatherChunk elements per rank, from which each rank keeps its predecessor's. It moves N-1
// times the data a ring step would; every call uses c's tag, one after another.
func shiftByGather(ctx context.Context, comm Communicator, send, recv []float32, c Call) error {
	n, rank := comm.Size(), comm.Rank()
	prev := (rank + n - 1) % n
	lens := make([]float32, 2*n)
	lens[2*rank], lens[2*rank+1] = float32(len(send)>>20), float32(len(send)&(1<<20-1))
	c2 := Call{Tag: c.Tag} // lengths must cross exactly: fp32, whatever c.Wire says
	if err := comm.AllGather(ctx, lens, EvenShards(2*n, n), c2); err != nil {
		return err
	}
	length := func(r int) int { return int(lens[2*r])<<20 | int(lens[2*r+1]) }
	if length(prev) != len(recv) {
		return fmt.Errorf("collective shift on rank %d: rank %d sends %d elements, recv holds %d", rank, prev, length(prev), len(recv))
	}
	longest := 0
	for r := range n {
		longest = max(longest, length(r))
	}
	rounds := (longest + gatherChunk - 1) / gatherChunk
	scratch := make([]float32, n*min(longest, gatherChunk))
	shards := make(Shards, n+1)
	for k := range rounds {
		for r := range n {
			shards[r+1] = shards[r] + max(0, min(gatherChunk, length(r)-k*gatherChunk))
		}
		lo := k * gatherChunk
		copy(scratch[shards[rank]:shards[rank+1]], send[min(lo, len(send)):])
		if err := comm.AllGather(ctx, scratch[:shards[n]], shards, c); err != nil {
			return err
		}
		copy(recv[min(lo, len(recv)):], scratch[shards[prev]:shards[prev+1]])
	}
	return nil
}
