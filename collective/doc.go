// Package collective implements qvd's collective operations — all-reduce, reduce-scatter,
// all-gather, broadcast and barrier over float32 buffers, and the typed AllReduceInt64 and
// BroadcastBytes for counters, flags and ids — as ring algorithms written
// against a small frame Transport, so the same schedule runs over an in-process transport in
// tests and over gRPC streams, raw TCP or shared memory in production.
// It sits in the parts layer of docs/architecture.md: it must not import cluster, zero, engine,
// trainer or anything above them; the transports and NCCL import it, never the reverse.
//
// Algorithms. AllReduce is the bandwidth-optimal ring of Patarasuk & Yuan (2009) as used in
// Baidu's ring all-reduce and NCCL: a reduce-scatter followed by an all-gather, each rank
// sending 2(N-1)/N of the buffer. Each rank's share is cut into pieces (Config.ChunkBytes)
// so sending, receiving and reducing overlap (pipelining). Every rank only ever sends to
// rank+1 and receives from rank-1.
//
// Element types. Buffers are []float32 in memory; Call.Wire chooses what goes on the wire:
// fp32, fp16 or bf16 (half the bytes). Reductions always add in fp32: a received 16-bit
// value is widened and added into the fp32 buffer, and partial sums are rounded to the wire
// format only when they are sent. After a reduction, the owner of each shard rounds it to
// the wire format before the all-gather, so every rank ends with identical bits. The typed
// calls run the same schedules and frames with exact element types (DTypeInt64, DTypeUint8),
// so no integer ever travels as a float.
//
// Failure. Every call takes a context, and a peer that sends nothing for Config.Timeout, or
// whose connection breaks, fails the call with a *PeerError naming that rank and its address
// — never a hang. A rank whose call fails sends an abort frame to its successor, so the
// failure travels round the ring in milliseconds instead of every rank waiting out its own
// timeout.
//
// Concurrency. Calls issued one at a time in the same order on every rank need no tags.
// Calls that run concurrently must each carry a distinct Call.Tag, the same on every rank.
//
// Implementations. Ring (ring.go, call.go, dispatch.go) is the Communicator over any
// Transport; the schedules it runs are pure arithmetic in schedule.go. NewInproc (inproc.go)
// is an in-process Transport with fault injection (delay, drop, partition, kill) for tests.
// Hierarchical (hier.go) composes two Communicators for a job on several hosts: a ring over
// shared memory among the ranks of each host and one over TCP among the ranks with the same
// local rank across hosts, so most bytes cross the cheap link. Over a transport that is a
// SharedMemory (shared.go; shared memory), Ring.AllocShared hands out buffers that every peer
// maps, and a float call on such buffers takes the direct path (direct.go): no frames, each
// rank reducing its shard from the peers' buffers in place and writing it into theirs.
// Topology and ChooseTransport
// (topology.go) decide, from the ranks' host ids, which data plane collective.transport auto
// gets. Roster and Jobs (roster.go) are the job roster and the per-job transport registry
// the network transports (tcpnet, grpcnet) share; Transports and CheckTransport name the data
// planes a job may choose. Package collectivetest is the conformance suite every
// Communicator implementation runs.
package collective
