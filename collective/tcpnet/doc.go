// Package tcpnet is qvd's raw-TCP data plane: a collective.Transport whose frames travel over
// plain TCP connections between ranks, authenticated with the job's secret. It is what NCCL
// and Gloo call a socket transport; the cluster's gRPC control plane only hands out the
// roster (every rank's data address) and the secret.
// It must not import cluster, zero, engine, trainer or anything above them
// (docs/architecture.md); it knows ranks only through the roster it is given.
//
// Lifecycle. A process calls Listen once at startup, so that the listener's address can be
// advertised to the cluster. When a job's roster is known, Listener.Transport returns that
// rank's Transport for the job. One listener serves any number of jobs at once: an accepted
// connection is routed to the job whose secret verifies its hello, so two groups on one
// listener never see each other's connections. Closing the listener closes its transports.
//
// Connections. Each direction of each pair of ranks has its own connection: rank a sends to
// rank b only on the connection a dialled to b, and receives from b only on the connection b
// dialled to a. Connections are dialled lazily, on the first Send to a peer, because the ring
// algorithms only ever talk to their two neighbours: an eager full mesh would open N(N-1)
// connections to use 2N of them. The first Send to a peer therefore pays the dial (bounded by
// its ctx and Config.DialTimeout, retrying while the peer is not yet listening or has not yet
// registered the job), and a Recv from a peer that has not dialled yet waits, within its ctx,
// for it to do so. A caller that wants the links up front (and a dead neighbour reported at
// setup) asserts the Transport to Connector and calls Connect with the peers it will send to.
//
// Handshake. The dialler opens with a KindHello frame carrying collective.NewHello(secret,
// job, rank, size, now). The acceptor verifies it against each job registered on the listener
// (the hello carries the job only inside its MAC, so routing is "whose secret verifies"),
// waiting up to Config.HandshakeTimeout for the job to register if it has not yet, and answers
// with its own hello, which the dialler verifies: both ends prove they hold the secret. A
// connection that fails is closed and logged with its remote address. Once a peer's
// connection has delivered data, a second connection claiming that peer is refused; before
// that, a newer one is kept and takes over if the first ends empty (a dialler that gave up
// mid-handshake and dialled again). The hello authenticates the opening of a connection; it does
// not encrypt or sign the frames that follow (like Gloo and NCCL sockets, the data plane
// trusts the network it runs on) unless Config.TLS is set.
//
// TLS. With Config.TLS every connection runs TLS 1.3, opened before the hello, with both
// ends' certificates verified (mutual TLS; package job uses the cluster's CA, see cluster.TLS):
// frames are then encrypted and integrity-protected, and a stranger without a certificate
// gets no further than the TLS handshake. A certificate refused by either end is
// collective.ErrAuth, not retried. One difference from plain TCP: a Send cut short by its
// ctx fails the connection instead of finishing the frame in the background, because
// crypto/tls cannot resume a record cut in the middle (every write error is permanent).
//
// Frames. A frame is the 40-byte collective header followed by its payload. Send writes both
// with one writev, never copying the payload, and returns once the kernel holds the bytes, so
// the caller may reuse the payload at once. Recv reads the header, bounds its length by
// collective.MaxPayload, then reads the payload straight into the caller's buffer.
//
// Failure. A connection that breaks, carries a malformed frame or a frame larger than the
// receiver's buffer is closed and stays failed: every later Send or Recv on it returns the
// same *collective.PeerError (ErrPeerGone or ErrProtocol) naming the rank. Connections are
// not re-dialled once established, because frames lost with a broken connection cannot be
// recovered by the transport; the job's collectives fail, and the cluster re-forms the group.
//
// Cancellation. A Send or Recv whose ctx ends returns the ctx's error at once and leaves the
// connection in step, so a collective call that fails does not break the link for the next
// one. A Recv cut short mid-frame keeps the part it read, and the next Recv resumes the frame.
// A Send cut short mid-frame copies the unsent rest of the frame and finishes it in the
// background (later Sends to that peer wait for it), so its frame is still delivered whole;
// a peer that does not take it within Config.FinishTimeout has its connection given up.
// Close unblocks every Send and Recv with collective.ErrClosed.
//
// Concurrency. Send may be called concurrently for any peers; Sends to one peer are
// serialised by a per-connection lock, so their frames never interleave. Recv for a given peer
// must be called from one goroutine at a time (the collective.Transport contract); Recvs from
// different peers may run concurrently. Steady-state Send and Recv allocate nothing: the only
// per-operation cost that allocates is watching a new ctx, once per distinct ctx (one per
// collective call when the caller passes the call's ctx), not per frame.
package tcpnet
