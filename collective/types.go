package collective

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/qvd/qvd/internal/half"
)

// Op is a reduction.
type Op uint8

// Reductions. Avg is Sum divided by the group size (in fp32, before rounding to the wire).
// Max and Min follow Go's builtin max and min (commutative: NaN wins, -0 < +0), so the
// result does not depend on the order in which ranks combine.
const (
	Sum Op = iota + 1
	Avg
	Max
	Min
)

func (o Op) String() string {
	switch o {
	case Sum:
		return "sum"
	case Avg:
		return "avg"
	case Max:
		return "max"
	case Min:
		return "min"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Call carries the per-call options.
type Call struct {
	// Tag identifies the call among concurrent ones: calls that may overlap must use
	// distinct tags, the same on every rank, below MaxUserTag. 0 means the next tag of the
	// communicator's sequence, which is right when calls are made one at a time in the same
	// order on every rank.
	Tag uint64
	// Wire is the element type sent (half.FP32, FP16 or BF16). The zero value is FP32.
	Wire half.Format
}

// MaxUserTag bounds explicit tags; tags at or above it are the automatic sequence.
const MaxUserTag = 1 << 62

// Shards partitions a buffer of Shards[len-1] elements among ranks: rank r owns
// [s[r], s[r+1]). len(s) is the group size + 1, s[0] = 0, and s is non-decreasing (a shard
// may be empty).
type Shards []int

// EvenShards splits n elements among size ranks as evenly as possible (the first n%size
// ranks get one more).
func EvenShards(n, size int) Shards {
	s := make(Shards, size+1)
	q, r := n/size, n%size
	for i := 0; i < size; i++ {
		s[i+1] = s[i] + q
		if i < r {
			s[i+1]++
		}
	}
	return s
}

// Validate checks that s partitions n elements among size ranks.
func (s Shards) Validate(n, size int) error {
	if len(s) != size+1 {
		return fmt.Errorf("collective: %d shard bounds for %d ranks, want %d", len(s), size, size+1)
	}
	if s[0] != 0 || s[size] != n {
		return fmt.Errorf("collective: shards cover [%d, %d), buffer has %d elements", s[0], s[size], n)
	}
	for i := 0; i < size; i++ {
		if s[i+1] < s[i] {
			return fmt.Errorf("collective: shard %d is [%d, %d): bounds must not decrease", i, s[i], s[i+1])
		}
	}
	return nil
}

// Communicator runs collectives among the ranks of one group. Every rank must make the
// same calls with the same lengths, shards, ops, roots and wire types. The typed calls
// (AllReduceInt64, BroadcastBytes) take the automatic tag sequence, like a Call with Tag 0.
type Communicator interface {
	Rank() int
	Size() int
	// AllReduce reduces buf element-wise across ranks, in place: afterwards every rank holds
	// the identical result.
	AllReduce(ctx context.Context, buf []float32, op Op, c Call) error
	// ReduceScatter reduces buf across ranks; afterwards buf[shards[r]:shards[r+1]] on rank
	// r holds the reduced shard r. The rest of buf is scratch (its contents undefined).
	ReduceScatter(ctx context.Context, buf []float32, shards Shards, op Op, c Call) error
	// AllGather fills buf on every rank from each rank r's buf[shards[r]:shards[r+1]].
	AllGather(ctx context.Context, buf []float32, shards Shards, c Call) error
	// Broadcast copies root's buf to every rank.
	Broadcast(ctx context.Context, buf []float32, root int, c Call) error
	// AllReduceInt64 reduces v element-wise across ranks, in place (Sum, Max or Min; exact,
	// a sum wrapping modulo 2^64 as Go's int64 addition does). For counters and flags, which
	// must not ride a float collective.
	AllReduceInt64(ctx context.Context, v []int64, op Op) error
	// BroadcastBytes copies root's b to every rank (every rank passes the same len(b)).
	BroadcastBytes(ctx context.Context, b []byte, root int) error
	// Barrier returns once every rank has entered it.
	Barrier(ctx context.Context) error
	// Close releases the communicator (not the transport it was given); safe to call twice.
	Close() error
}

// Config tunes a communicator. YAML under `collective:`.
type Config struct {
	// Transport is the data plane: "auto" (the default: shared memory among the ranks of one
	// host, TCP between hosts, hierarchical when both; see ChooseTransport), "shm" (shared
	// memory; every rank on one host), "tcp" (a raw-TCP data plane authenticated through
	// gRPC), "grpc" (streams over the cluster's gRPC connections) or "nccl" (NCCL between
	// GPUs, its unique id exchanged over the gRPC communicator; needs device.type cuda).
	Transport string `yaml:"transport" json:"transport"`
	// Timeout is how long a call waits for any frame from the peer it is receiving from
	// before failing with an error naming it; a stalled or partitioned peer is detected this
	// fast (a dead one, whose connection breaks, at once).
	Timeout time.Duration `yaml:"timeout" json:"timeout"`
	// ChunkBytes is the pipelining piece size on the wire.
	ChunkBytes int `yaml:"chunk_bytes" json:"chunk_bytes"`
	// ShmChunkBytes is the piece size of rings over shared memory (0, the default:
	// ChunkBytes). Larger pieces pay off there in bandwidth (2 MiB: +12% busbw at 2 ranks) but
	// cost resident memory: the ring's receive buffers grow with the piece (about 20 MiB per
	// rank more at 2 MiB; docs/performance.md), which is why the default stays at ChunkBytes.
	ShmChunkBytes int `yaml:"shm_chunk_bytes" json:"shm_chunk_bytes"`
}

// DefaultConfig: auto, 20 s timeout, 512 KiB pieces, on shared memory too. Pieces of 256 KiB
// to 1 MiB measured best for gRPC and TCP on loopback (2026-11-22, 2 cores: one gRPC stream
// moved 2.25 GB/s with 1 MiB messages; larger pieces did not help, see also
// docs/performance.md on gRPC message sizes).
func DefaultConfig() Config {
	return Config{Transport: TransportAuto, Timeout: 20 * time.Second, ChunkBytes: 512 << 10}
}

// ForShm is c for a ring over shared memory: its pieces are ShmChunkBytes where that is set.
func (c Config) ForShm() Config {
	if c.ShmChunkBytes > 0 {
		c.ChunkBytes = c.ShmChunkBytes
	}
	return c
}

// The values of Config.Transport (see its doc), for callers that branch on one.
const (
	TransportAuto = "auto"
	TransportShm  = "shm"
	TransportTCP  = "tcp"
	TransportGRPC = "grpc"
	TransportNCCL = "nccl"
	// TransportInproc names the in-process transport (NewInproc): Config.Validate accepts
	// it for tests, CheckTransport does not.
	TransportInproc = "inproc"
)

// transports are the data planes a job may name, in the order Config.Transport documents.
var transports = []string{TransportAuto, TransportShm, TransportTCP, TransportGRPC, TransportNCCL}

// Transports returns the values a job may give `collective.transport` (and qvd's
// --transport flags): auto, shm, tcp, grpc, nccl. This package is the one place that knows
// them.
func Transports() []string { return slices.Clone(transports) }

// CheckTransport returns an error naming the allowed values unless name is one of
// Transports. The error names no key: callers prefix the field or flag.
func CheckTransport(name string) error {
	if slices.Contains(transports, name) {
		return nil
	}
	return fmt.Errorf("must be %s, got %q", transportChoice(), name)
}

// transportChoice is "auto, shm, tcp, grpc or nccl".
func transportChoice() string {
	n := len(transports)
	return strings.Join(transports[:n-1], ", ") + " or " + transports[n-1]
}

// Validate checks the fields; errors name the field.
func (c Config) Validate() error {
	switch {
	case c.Transport != TransportInproc && CheckTransport(c.Transport) != nil:
		return fmt.Errorf("transport: must be %s (%s in tests), got %q", transportChoice(), TransportInproc, c.Transport)
	case c.Timeout < 100*time.Millisecond || c.Timeout > time.Hour:
		return fmt.Errorf("timeout: must be between 100ms and 1h, got %v", c.Timeout)
	case c.ChunkBytes < 4<<10 || c.ChunkBytes > 64<<20:
		return fmt.Errorf("chunk_bytes: must be between 4 KiB and 64 MiB, got %d", c.ChunkBytes)
	case c.ShmChunkBytes != 0 && (c.ShmChunkBytes < 4<<10 || c.ShmChunkBytes > 64<<20):
		return fmt.Errorf("shm_chunk_bytes: must be 0 (chunk_bytes) or between 4 KiB and 64 MiB, got %d", c.ShmChunkBytes)
	}
	return nil
}

// Errors callers test for.
var (
	// ErrProtocol: a peer sent a frame that does not fit the call (wrong length, element
	// type, tag, step or offset, or a malformed header).
	ErrProtocol = errors.New("collective: protocol violation")
	// ErrTimeout: no frame arrived from a peer within Config.Timeout.
	ErrTimeout = errors.New("collective: peer timed out")
	// ErrPeerGone: the connection to a peer broke or was closed.
	ErrPeerGone = errors.New("collective: peer connection lost")
	// ErrAborted: another rank failed the call and sent an abort round the ring.
	ErrAborted = errors.New("collective: aborted by another rank")
	// ErrClosed: the communicator or transport is closed.
	ErrClosed = errors.New("collective: closed")
)

// PeerError is a failure attributed to one rank.
type PeerError struct {
	Rank int    // the rank at fault (for an abort: the rank that failed first)
	Addr string // its address, when known
	Op   string // the call, e.g. "all-reduce (tag 7)"
	Err  error  // ErrTimeout, ErrPeerGone, ErrProtocol, ErrAborted, a context error, ...
}

func (e *PeerError) Error() string {
	who := fmt.Sprintf("rank %d", e.Rank)
	if e.Addr != "" {
		who += " (" + e.Addr + ")"
	}
	if e.Op == "" {
		return fmt.Sprintf("collective: %s: %v", who, e.Err)
	}
	return fmt.Sprintf("collective %s: %s: %v", e.Op, who, e.Err)
}

func (e *PeerError) Unwrap() error { return e.Err }
