// Package shmnet is qvd's shared-memory data plane: a collective.Transport for the ranks of
// one job that run on the same host, in place of loopback TCP. package job builds it with New
// once the local group (job, rank, size, secret) is known and hands it to collective.NewRing.
// The ranks must see the same Group.Dir (containers: a shared IPC namespace, which shares
// /dev/shm); they need not share a pid namespace.
// It must not import cluster, zero, engine, trainer or anything above them
// (docs/architecture.md); it knows ranks only through the roster it is given.
//
// Layout. Each rank creates one receive segment, a file qvd-<job>-<rank>-<pid> in Group.Dir
// (default /dev/shm), mode 0600, created with O_EXCL|O_NOFOLLOW. It holds a header page and
// one slot per sending rank: a control page (head and tail counters on separate cache lines,
// the futex words, the sender's attach record) followed by a single-producer/single-consumer
// byte ring of Config.RingBytes. Frames are records: a 64-byte header carrying the
// collective.Header, then the payload, each record starting on a cache line. The sender
// copies the payload from the caller's buffer into the ring and publishes head every 64 KiB,
// so the receiver copies out while the rest goes in; a frame larger than the ring streams
// through it. The receiver copies straight into the caller's buffer, or through
// collective.DirectReceiver (RecvInto) into the Ring's destination, or, through
// collective.ApplyReceiver (RecvApply), hands the payload where it lies in the ring, part by
// part, to a function that reduces or copies it into the destination before the part's room
// is given back: one copy on the sending side, none but the reduction's own pass on the
// receiving side. Only the rings actually used are touched (the ring algorithms use
// one per rank); the sender fallocates its slot on first use, so a full tmpfs is an error
// naming --shm-size rather than a SIGBUS.
//
// Shared buffers (shared.go). Each segment ends in an arena of Config.ArenaBytes, a hole in
// the file that every peer maps at attach. The transport is a collective.SharedMemory:
// AllocShared reserves a buffer's pages there (fallocate) and FreeShared punches them out;
// a progress record in the header, with a futex word, lets the Ring's direct path
// (collective/direct.go) synchronise, so that a collective on buffers allocated here on
// every rank reads the peers' buffers in place: no ring, no copy into shared memory. The
// waits follow the rings' policy (spin, then futex with PollInterval timeouts probing the
// peer's lock), so a rank killed in a direct call is named as fast. Buffers still allocated
// at Close stay mapped, through a descriptor of their own that does not hold the liveness
// lock, until FreeShared.
//
// Waiting. A Send waiting for room or a Recv waiting for data polls the counter for
// Config.Spin (also where the group has more ranks than the host has processors: training's
// many small reductions ran 1.7× faster so, see Config.Spin), yielding the processor between
// polls, then sets its waiting flag and the
// counter value it needs and sleeps on a futex word in the control page (FUTEX_WAIT, shared,
// not private) with a Config.PollInterval timeout. The other side issues FUTEX_WAKE only
// when the flag is set and the counter has reached the value wanted, so a busy ring makes no
// system calls. All counter and flag accesses are sync/atomic on the mapping (sequentially
// consistent), which is what makes the flag-then-recheck protocol free of lost wake-ups.
//
// Faults. Close sets a closed flag in this rank's header and in its slots in the peers'
// segments and wakes every futex word: this rank's blocked calls return collective.ErrClosed,
// its peers' a *collective.PeerError wrapping collective.ErrPeerGone naming it, after the
// frames it had published. A peer killed outright sets no flag. Liveness is a kernel-held
// lock, not a pid: each rank takes flock(LOCK_EX) on its own segment when it creates it and
// holds it, through a descriptor it keeps open, until Close; each peer keeps a descriptor
// of that file, opened before the unlink, and a sleeping call probes it with
// flock(LOCK_SH|LOCK_NB) on every futex timeout. EWOULDBLOCK means the owner is there; a
// granted lock means its descriptor closed, that is its process died (the kernel closes a
// dead process's descriptors), and the call fails with ErrPeerGone naming it. flock locks
// belong to the open file description, so this works on unlinked files, across pid
// namespaces (containers sharing an IPC namespace, where every rank may be pid 1) and
// whatever a dead rank's pid is reused for. A SIGKILL is reported within about PollInterval
// (tests measure well under a second; the Ring's own Config.Timeout handles a peer that is
// alive but hung).
// A Send cut short by its ctx in the middle of a streamed frame marks the link cut (the
// receiver cannot resynchronise); a Recv cut short mid-frame drops the rest of that frame.
//
// Security. A segment is only attached if it is a regular file owned by this uid with mode
// exactly 0600, held by a live creator (its lock), and if its header's token, HMAC-SHA256 of
// the job's secret over the header (rank, size, pid, ring size, a random nonce), verifies.
// The attaching rank then writes the nonce of its own segment and its proof, HMAC(secret,
// job | ranks | its pid | the segment's nonce | its own segment's nonce), which the creator
// verifies before counting it attached; the nonce it wrote must be that of the segment the
// creator mapped as that rank's, so the process that attached is the one that made the
// peer's segment (the pid is recorded for messages only: it cannot identify a process in
// another pid namespace). A failure is an error wrapping collective.ErrAuth that names the
// file and the reason. The data itself is not authenticated frame by frame: the trust
// boundary is the uid plus the secret, as with Gloo's and NCCL's shared-memory transports.
//
// Cleanup. New returns only once every peer has attached to this rank's segment, and then
// unlinks it: from then on the memory lives only in the mappings, and dies with the last
// process, however it dies. The window in which a name exists (between create and the last
// attach) is covered by a sweep at every New: files qvd-<job>-<rank>-<pid> in the directory
// owned by this uid whose lock can be taken (flock LOCK_EX|LOCK_NB: no live process holds
// them, in whatever pid namespace) are removed and logged; the pid in the name is not
// consulted. A creator that a sweep beats to the lock of its brand-new file finds the name
// gone once it has the lock, and creates it again. Each rank holds one descriptor per
// segment (its own and each peer's) for its life; none is left after Close.
//
// Concurrency. Send may be called concurrently for different peers; Sends to one peer are
// serialised. Recv for a peer is called by one goroutine at a time (the Transport contract).
// The transport starts no goroutines: all waiting happens in the caller's.
//
// Figures against OpenMPI's shared memory and gloo, measured across processes with qvd bench,
// are in docs/performance.md ("Shared memory and hierarchical collectives").
package shmnet
