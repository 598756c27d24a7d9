// Package grpcnet is a collective.Transport whose frames travel over gRPC bidirectional
// streams between the gRPC servers the qvd processes run anyway (the cluster's control plane
// registers its services on the same server).
// It must not import cluster, zero, engine, trainer or anything above them
// (docs/architecture.md); it knows ranks only through the roster it is given.
//
// Lifecycle. A process builds its server with ServerOptions, calls NewHub on it before it
// serves, serves it on Listener(l) (frame-header read-ahead: one syscall per received HTTP/2
// frame instead of two; a plain listener works too, slower), and, when a job's roster is known, Hub.Transport for that job: a Group with the
// job id, this rank, every rank's server address and the job's secret. One Hub serves any
// number of jobs: an incoming stream claims a job (gRPC metadata) and is handed to that
// job's transport only if its hello verifies with that job's secret, so two jobs on one Hub
// never see each other's frames. Hub.Close closes the Hub's transports; the server remains
// the caller's.
//
// Wire. The service is written by hand (no protoc): qvd.collective.v1.Frames/Stream, one
// bidirectional stream per ordered pair of ranks, opened by the sender to the receiver's
// server, lazily on the first Send (the rings only talk to two neighbours; a full mesh of
// streams would be wasted). A message is a raw frame — the 40-byte collective header and
// the payload — moved by an encoding.CodecV2 ("qvdframe") so that no payload goes through
// protobuf. The first message of a stream is a KindHello frame carrying
// collective.NewHello(secret, job, rank, size, now); the receiving Hub verifies it
// (collective.VerifyHello) and answers with its own hello, so each end proves the secret to
// the other and the sender knows it reached the rank it meant. A stream that opens with
// anything else, a bad hello, a job the Hub does not run (after waiting for it to register)
// or a rank that already has a stream is refused: the Hub logs why with the remote address,
// and the sender's Send fails with a *collective.PeerError naming the peer and wrapping
// collective.ErrAuth (gRPC status Unauthenticated) or ErrProtocol. The hello authenticates
// the opening of a stream; it neither encrypts nor signs the frames after it (TLS, given in
// Group.DialOptions and on the server, would).
//
// Zero copy, and when the caller's payload is free again. Send lends gRPC the caller's
// payload (payloads of 32 KiB and less are copied, which costs less than the bookkeeping).
// gRPC's SendMsg returns while the frame is still queued for the connection's writer
// goroutine, so returning then would let the caller overwrite bytes not yet sent — a hazard
// seen in measurements (corrupt sums with GOMAXPROCS=1), and what TestPayloadReuseAfterSend
// catches. Instead the payload is handed to gRPC as a mem.Buffer whose pool is the send slot
// itself: gRPC calls its Put when the writer has copied the last byte into the connection's
// write buffer (or dropped the frame), and only then does Send return. The alternative,
// copying every payload into a buffer gRPC frees, measured about a fifth slower (it adds a
// memcpy of every byte sent; see bench_test.go). Send's doc says how a frame is given up
// safely when its ctx ends.
//
// Receiving. A reader goroutine per incoming stream parses each frame
// (collective.ParseHeader, length, sender) as it arrives, keeps gRPC's receive buffers and
// queues the frame (up to eight, or 16 MiB, per peer; then HTTP/2 flow control holds the
// sender back).
// Recv copies the payload into the caller's buffer and returns gRPC's buffers to its pool.
// gRPC reads into a pool that does not zero its buffers (pool.go): zeroing cost an eighth of
// a stream's CPU and bought nothing, since gRPC fills every byte it reads.
//
// Failure. The two directions between a pair of ranks fail together, once, for good: a
// stream that breaks (the peer's process died, its server stopped, it closed its transport),
// a malformed frame, a frame larger than the Recv buffer, a refused handshake, or silence —
// the receiving end sends a heartbeat every second on each stream, and a sender that hears
// none for five seconds declares the peer gone, since gRPC's client keepalive cannot notice a
// vanished peer in less than about 15 s; the server keepalive of ServerOptions notices a
// vanished sender in about four. Every later Send and Recv for that peer returns the same
// *collective.PeerError (ErrPeerGone, ErrProtocol or ErrAuth) naming it, after Recv has
// delivered the frames that arrived before. Links are not reopened: frames lost with a stream
// cannot be recovered by the transport, so the job's collectives fail and the cluster
// re-forms the group. Close makes blocked Sends and Recvs return collective.ErrClosed.
//
// Concurrency. Send may be called concurrently for any peers; Sends to one peer are
// serialised, so their frames never interleave. Recv for a given peer must be called from
// one goroutine at a time; Recvs from different peers may run concurrently. Steady-state
// Send and Recv allocate nothing in this package (gRPC allocates a few small objects per
// message).
package grpcnet
