package grpcnet

import (
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/keepalive"

	"github.com/qvd/qvd/collective"
)

// Transport settings measured on our machines (2026-11-22, grpc v1.85.0, 2 cores, processes
// on loopback, medians): with them one CodecV2 stream moved 2.25 GB/s against 2.02 with
// gRPC's defaults, and a 2-rank ring all-reduce of 64 MiB reached 1.10 GB/s busbw.
const (
	// streamWindow and connWindow are the HTTP/2 flow-control windows. gRPC's 64 KiB start
	// (grown by BDP probing) throttles a single large stream; 16/32 MiB measured best and
	// 64 MiB did not help. Setting them also turns BDP probing off.
	streamWindow = 16 << 20
	connWindow   = 32 << 20
	// ioBufferSize is gRPC's per-connection write buffer: the largest single gain over the
	// 32 KiB default (more data per syscall); 4 MiB did not help, and a write buffer of 0
	// halves throughput. The read buffer is off (0): gRPC's HTTP/2 framer then reads frames
	// straight from the socket into its message buffers instead of copying them out of a
	// buffered reader, one copy of every received byte less (~+15% busbw at 2 ranks, 64 MiB,
	// 1.16x in 5 interleaved runs) for a few more, smaller read syscalls.
	ioBufferSize = 1 << 20
	// maxMessage is the largest gRPC message a frame can make: a header and the largest
	// payload collective.ParseHeader admits. gRPC's default receive limit is 4 MiB.
	maxMessage = collective.HeaderSize + collective.MaxPayload

	// Server keepalive: a client connection that has sent nothing for serverPingAfter is
	// pinged, and closed if the ping is not answered within serverPingTimeout, so frames
	// from a peer whose host vanished fail in about four seconds (gRPC allows servers to ping
	// every second).
	serverPingAfter   = 2 * time.Second
	serverPingTimeout = 2 * time.Second
	// Client keepalive is a backstop only: gRPC does not let clients ping more often than
	// every 10 s. Outgoing streams are watched by the receiver's heartbeats instead
	// (heartbeatEvery, silenceLimit).
	clientPingAfter   = 10 * time.Second
	clientPingTimeout = 5 * time.Second
	// clientPingFloor is the server's enforcement policy: gRPC clients cannot ping more often
	// than every 10 s, so half of that never closes a well-behaved client.
	clientPingFloor = clientPingAfter / 2
)

// ServerOptions returns the options the process's gRPC server must be built with for frame
// streams: flow-control windows and buffers sized for large tensors, message limits that
// admit collective.MaxPayload, and keepalive that notices silently dead peers. They suit the
// control-plane services that share the server too.
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		grpc.InitialWindowSize(streamWindow),
		grpc.InitialConnWindowSize(connWindow),
		grpc.WriteBufferSize(ioBufferSize),
		grpc.ReadBufferSize(0),
		grpc.MaxRecvMsgSize(maxMessage),
		grpc.MaxSendMsgSize(maxMessage),
		grpc.KeepaliveParams(keepalive.ServerParameters{Time: serverPingAfter, Timeout: serverPingTimeout}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: clientPingFloor, PermitWithoutStream: true}),
		experimental.BufferPool(framePool),
	}
}

// DialOptions returns the options of the transport's client connections. They use plaintext
// credentials; Group.DialOptions are applied after them, so TLS credentials given there
// replace it.
//
// Retries are disabled: an uncommitted gRPC stream keeps a reference to every message it
// sent so that it can replay them, which would hold a payload that Send lends zero-copy (the
// handshake commits each stream before any payload is sent, so this is a second guard).
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithInitialWindowSize(streamWindow),
		grpc.WithInitialConnWindowSize(connWindow),
		grpc.WithWriteBufferSize(ioBufferSize),
		grpc.WithReadBufferSize(0),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxMessage), grpc.MaxCallSendMsgSize(maxMessage)),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{
			Time: clientPingAfter, Timeout: clientPingTimeout, PermitWithoutStream: true,
		}),
		grpc.WithDisableRetry(),
		experimental.WithBufferPool(framePool),
		// A peer that is not listening yet (ranks start at slightly different times) is
		// retried quickly: gRPC's default backoff starts at 1 s and grows to 2 minutes.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 50 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: 2 * time.Second},
			MinConnectTimeout: 5 * time.Second,
		}),
	}
}

// tuning holds the timings of a Hub and the transports it makes. Production uses
// defaultTuning; tests shorten it to exercise failures quickly.
type tuning struct {
	// handshake bounds how long an incoming stream may take to present its hello and how
	// long it waits for its job to register on this Hub (a peer may learn the roster a little
	// before this process does).
	handshake time.Duration
	// heartbeatEvery is how often the receiving end of a stream sends a heartbeat back, and
	// silenceLimit how long the sending end waits without one before it declares the peer
	// gone: gRPC's client keepalive cannot notice a vanished peer in less than ~15 s.
	heartbeatEvery time.Duration
	silenceLimit   time.Duration
	// releaseGrace is how long a Send that gives up on a frame (ctx ended, peer failed,
	// transport closed) waits for gRPC to hand the payload back after the stream is reset,
	// before it closes the connection under gRPC so that no byte of the payload can reach
	// the wire after Send returns.
	releaseGrace time.Duration
	// retryEvery spaces the attempts to open a stream to a peer whose Hub does not know the
	// job yet.
	retryEvery time.Duration
	// linger bounds how long Close waits for its peers to have read everything it sent
	// before it resets the streams (see transport.linger).
	linger time.Duration
}

var defaultTuning = tuning{
	handshake:      10 * time.Second,
	heartbeatEvery: time.Second,
	silenceLimit:   5 * time.Second,
	releaseGrace:   200 * time.Millisecond,
	retryEvery:     100 * time.Millisecond,
	linger:         3 * time.Second,
}
