// Package nccl runs qvd's collectives through NVIDIA's NCCL between GPUs: Comm implements
// collective.Communicator on host buffers ([]float32, and the typed []int64 and []byte
// calls) by staging them through the GPU, and exports device-buffer entry points
// (AllReduceDevice, ReduceScatterDevice, AllGatherDevice, BroadcastDevice) for a GPU engine
// whose data already lives on the device.
// It must not import engine, zero, trainer or anything above them (docs/architecture.md): the
// CUDA engine hands it device pointers, not its types.
//
// Build. Everything that works is built only with the build tag cuda (go build -tags cuda):
// it uses gorgonia.org/cu, whose package initialisation calls cuInit and exits the process
// without a GPU, so a default build must not import it. In a default build this package is
// this documentation and some unexported helpers; nothing in it pretends to work. NCCL itself
// is never linked: libnccl.so.2 is loaded at run time with internal/dynlib ($QVD_NCCL_LIBRARY,
// then libnccl.so.2 through the dynamic loader, then the copies pip wheels install), so one
// binary runs beside whatever NCCL the GPU machine has, and a machine without it gets an error
// naming NCCL and QVD_NCCL_LIBRARY. NCCL 2.14 or newer is required (non-blocking
// communicators, see below).
//
// Calling NCCL without cgo. The functions are bound with purego. ncclCommInitRankConfig takes
// the 128-byte ncclUniqueId by value; on x86-64 System V a struct larger than 16 bytes is of
// class MEMORY and is copied onto the stack, and purego v0.11.3 implements exactly that on
// linux/amd64 (struct_amd64.go: addStruct places a struct over 64 bytes on the stack as raw
// eightbytes and takes no integer register for it), and on arm64 the AAPCS64 rule (a pointer
// to a copy). The tests check it against a C library built at test time with NCCL's
// signatures that checks every byte of the id, so no cgo shim is needed for NCCL.
//
// Bootstrap. New(ctx, bootstrap, device) needs a working communicator among the same ranks
// (the cluster's gRPC one in production): the ranks first all-reduce (AllReduceInt64) a flag
// saying whether each could load NCCL and open its GPU (so a rank that cannot fails every
// rank at once instead of leaving them waiting), rank 0 calls ncclGetUniqueId, and its NCCL
// version and the 128 bytes of the id are broadcast with BroadcastBytes. Each rank then calls
// ncclCommInitRankConfig.
//
// Never hanging. NCCL waits forever for a rank that died. Every communicator is created
// non-blocking (ncclConfig_t.blocking = 0), so no NCCL call blocks the host: initialisation
// and enqueueing return ncclInProgress and are polled with ncclCommGetAsyncError, and the
// stream is polled with cuStreamQuery. Every call honours its context: when it ends first the
// communicator is aborted (ncclCommAbort makes NCCL's kernels and threads give up) and the
// call fails with an error that wraps the context's error and names the deadline. Contexts
// without a deadline (the training loop's) are bounded by the communicator's timeout
// (DefaultTimeout, or SetTimeout), since NCCL between GPUs of one machine would otherwise
// wait for a dead rank forever. An aborted communicator fails every later call; make a new
// one.
//
// Call matching. NCCL matches calls by their order on each rank, not by tags, and a mismatch
// (a different length, collective or root) silently corrupts data or hangs. So before every
// call of a group of more than one rank, Comm all-reduces (max) the call's description — kind,
// tag, length, wire type, reduction, root, a hash of the shards — and its bitwise complement,
// which gives every rank both the largest and the smallest value of each field; if they differ
// every rank fails the call with an error wrapping collective.ErrProtocol, before any data
// moves. The description costs one small all-reduce per call (tens of microseconds), which is
// what buys the conformance suite's mismatch guarantee. Calls are serialised per Comm; calls
// issued concurrently from several goroutines must still reach NCCL in the same order on
// every rank, which tags cannot arrange: concurrent calls that arrive in different orders fail
// with that error rather than mixing up data.
//
// Element types. Buffers are float32 on the host; Call.Wire chooses what crosses the network:
// fp32, or fp16/bf16 (rounded on the host with internal/vec before the upload, half the
// bytes). NCCL reduces 16-bit data in 16 bits, rounding each partial sum, which is within the
// error bound the conformance suite allows for the ring. Avg is a Sum followed, on the host, by
// a division in float32 and a rounding to the wire type, so an fp32 average equals the ring's
// bit for bit (NCCL's own ncclAvg pre-multiplies by 1/n, which is not). On the device entry
// points Avg is ncclAvg. As with the ring, a group of one leaves host data untouched (the
// collective runs in fp32 whatever the wire). AllReduceInt64 (ncclInt64 with ncclSum, ncclMax
// or ncclMin) and BroadcastBytes (ncclUint8) stage their elements through the GPU as they
// are, so counters, flags and ids are exact.
//
// Uneven shards. NCCL's ReduceScatter and AllGather need equal shards. Comm lays shard r out
// at r·m, m the largest shard, padding with zeros: free for EvenShards (at most one element
// per rank), but a very skewed partition moves size·m elements instead of n.
package nccl
