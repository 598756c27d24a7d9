package collective

import (
	"context"
	"sync/atomic"
)

// WireCounts holds the bytes a rank's Transport sent and received, by the collective each
// frame belonged to (the Op code in its header), counting the frame header and its payload:
// what the ring put on the wire, measured per frame, not derived from the algorithm's
// 2(N-1)/N. The counters are atomic; read them at any time, from any goroutine.
type WireCounts struct {
	sent, recv [numOpCodes]atomic.Uint64
}

// numOpCodes covers the frame op codes OpAllReduce..OpShift; index 0 collects frames with
// any other code (none are sent today).
const numOpCodes = int(OpShift) + 1

// OpName names a frame op code for metrics ("all_reduce", ...); "other" for an unknown code.
func OpName(op uint8) string {
	switch op {
	case OpAllReduce:
		return "all_reduce"
	case OpReduceScatter:
		return "reduce_scatter"
	case OpAllGather:
		return "all_gather"
	case OpBroadcast:
		return "broadcast"
	case OpBarrier:
		return "barrier"
	case OpShift:
		return "shift"
	}
	return "other"
}

// OpCodes lists the frame op codes WireCounts reports, in order.
func OpCodes() []uint8 {
	return []uint8{OpAllReduce, OpReduceScatter, OpAllGather, OpBroadcast, OpBarrier}
}

// Sent and Received return the bytes counted for frames of op (an unknown code reads the
// "other" counter).
func (w *WireCounts) Sent(op uint8) uint64     { return w.sent[opIndex(op)].Load() }
func (w *WireCounts) Received(op uint8) uint64 { return w.recv[opIndex(op)].Load() }

func opIndex(op uint8) int {
	if int(op) < numOpCodes {
		return int(op)
	}
	return 0
}

// CountingTransport is a Transport that counts the bytes of the frames passing through it.
type CountingTransport interface {
	Transport
	WireCounts() *WireCounts
}

// Count wraps t so that every frame it sends or receives is added to a WireCounts. The
// wrapper keeps t's DirectReceiver and ApplyReceiver extensions when t has them, so the
// Ring's zero-copy receive paths are unchanged. Close closes t.
func Count(t Transport) CountingTransport { return CountInto(t, &WireCounts{}) }

// CountInto is Count adding to w, so that the transports of a hierarchical communicator
// (shared memory within the host, TCP across) report one rank's traffic together.
func CountInto(t Transport, w *WireCounts) CountingTransport {
	c := &counting{Transport: t, counts: w}
	d, direct := t.(DirectReceiver)
	a, apply := t.(ApplyReceiver)
	switch {
	case direct && apply:
		return &countingDirectApply{countingDirect: &countingDirect{counting: c, direct: d}, apply: a}
	case apply:
		return &countingApply{counting: c, apply: a}
	case direct:
		return &countingDirect{counting: c, direct: d}
	}
	return c
}

type counting struct {
	Transport
	counts *WireCounts
}

var (
	_ CountingTransport = (*counting)(nil)
	_ DirectReceiver    = (*countingDirect)(nil)
	_ ApplyReceiver     = (*countingApply)(nil)
	_ ApplyReceiver     = (*countingDirectApply)(nil)
)

func (c *counting) WireCounts() *WireCounts { return c.counts }

// Unwrap returns the counted transport: the Ring finds its SharedMemory extension there
// (the direct path adds its bytes to WireCounts itself).
func (c *counting) Unwrap() Transport { return c.Transport }

func (c *counting) Send(ctx context.Context, peer int, h Header, payload []byte) error {
	err := c.Transport.Send(ctx, peer, h, payload)
	if err == nil {
		c.counts.sent[opIndex(h.Op)].Add(uint64(HeaderSize + len(payload)))
	}
	return err
}

func (c *counting) Recv(ctx context.Context, peer int, buf []byte) (Header, []byte, error) {
	h, p, err := c.Transport.Recv(ctx, peer, buf)
	if err == nil {
		c.counts.recv[opIndex(h.Op)].Add(uint64(HeaderSize + len(p)))
	}
	return h, p, err
}

type countingDirect struct {
	*counting
	direct DirectReceiver
}

func (c *countingDirect) RecvInto(ctx context.Context, peer int, buf []byte, dst func(Header) []byte) (Header, []byte, error) {
	h, p, err := c.direct.RecvInto(ctx, peer, buf, dst)
	if err == nil {
		c.counts.recv[opIndex(h.Op)].Add(uint64(HeaderSize + len(p)))
	}
	return h, p, err
}

// countingApply and countingDirectApply keep the ApplyReceiver extension as well (shared
// memory has both extensions). A frame applied in place comes back without a payload: its
// length is the header's.
type countingApply struct {
	*counting
	apply ApplyReceiver
}

type countingDirectApply struct {
	*countingDirect
	apply ApplyReceiver
}

func (c *countingApply) RecvApply(ctx context.Context, peer int, buf []byte, apply func(Header) func(off int, p []byte)) (Header, []byte, error) {
	return c.counting.recvApply(ctx, c.apply, peer, buf, apply)
}

func (c *countingDirectApply) RecvApply(ctx context.Context, peer int, buf []byte, apply func(Header) func(off int, p []byte)) (Header, []byte, error) {
	return c.counting.recvApply(ctx, c.apply, peer, buf, apply)
}

func (c *counting) recvApply(ctx context.Context, a ApplyReceiver, peer int, buf []byte, apply func(Header) func(off int, p []byte)) (Header, []byte, error) {
	h, p, err := a.RecvApply(ctx, peer, buf, apply)
	if err == nil {
		c.counts.recv[opIndex(h.Op)].Add(uint64(HeaderSize) + uint64(h.Length))
	}
	return h, p, err
}
