package collective

import (
	"context"
	"errors"
	"time"
)

// SharedMemory is an optional Transport extension for transports whose ranks map one
// another's memory (shmnet). It hands out buffers in a per-rank shared arena that every peer
// has mapped (the analogue of NCCL's user-buffer registration or MPI_Alloc_mem), and a small
// progress record per rank, with a futex-backed wait on a peer's, that the Ring's direct
// path (direct.go) synchronises on. A Ring over such a transport runs a float collective on a
// buffer that lies in the arena on every rank without frames: each rank reduces its shard
// reading the peers' buffers where they lie and copies the peers' shards out of theirs.
//
// Post, Posted and Await are the Ring's: one call at a time (the Ring serialises its direct
// calls). AllocShared and FreeShared may be called from any goroutine.
type SharedMemory interface {
	// AllocShared returns n zeroed float32s in this rank's arena; an error (wrapping
	// ErrNoShared) when the arena is absent, full, or the shared-memory filesystem is.
	// The buffer stays valid until FreeShared, even after the transport is closed.
	AllocShared(n int) ([]float32, error)
	// FreeShared returns a buffer AllocShared gave (the whole of it).
	FreeShared(buf []float32) error
	// SharedOffset reports where buf starts in this rank's arena (a byte offset), if
	// buf lies in it.
	SharedOffset(buf []float32) (off int64, ok bool)
	// PeerShared returns peer's n float32s at byte offset off of its arena, as mapped in
	// this process; an error wrapping ErrProtocol if they are not all in its arena. Valid
	// between Hold and Unhold.
	PeerShared(peer int, off int64, n int) ([]float32, error)
	// Post publishes this rank's progress record and wakes peers waiting for it.
	Post(p Posted)
	// Posted reads peer's progress record.
	Posted(peer int) Posted
	// Await blocks until peer has posted a Step of at least step. It fails with a
	// *PeerError naming the rank at fault when peer posts an abort (ErrAborted, or
	// ErrPeerGone if the rank it blames has died), closes or dies (ErrPeerGone), or posts
	// nothing new for timeout (ErrTimeout); with ErrClosed once the transport closes, and
	// with ctx's error once ctx ends.
	Await(ctx context.Context, peer int, step uint64, timeout time.Duration) error
	// Hold keeps the peers' mappings valid (Close waits) until Unhold; it fails with
	// ErrClosed once the transport is closed.
	Hold() error
	Unhold()
}

// Posted is one rank's progress through the Ring's direct calls, published in shared
// memory. The call's fields describe the buffer and the arguments so that every rank can
// check that its peers make the same call on the same lengths (a mismatch is ErrProtocol,
// not a silent mis-read).
type Posted struct {
	// Step counts the synchronisation steps this rank has reached; PostedAbort set means
	// it gave up (the direct path is then dead on every rank) and Fault names the rank it
	// blames.
	Step   uint64
	Tag    uint64
	Off    int64  // the call's buffer: byte offset in the poster's arena
	N      int64  // elements of the buffer
	Call   uint64 // op, reduction, wire type and root (directCallWord)
	Shards uint64 // FNV-1a of the call's shards
	Fault  int64
}

// PostedAbort marks a Posted.Step of a rank that abandoned a direct call.
const PostedAbort = uint64(1) << 63

// ErrNoShared: the communicator or transport has no shared arena to allocate from, or it
// is full.
var ErrNoShared = errors.New("collective: no shared memory to allocate from")

// SharedAllocator is what a Communicator offers when it can hand out registered buffers
// (a Ring over a SharedMemory transport; a Hierarchical whose local group is one). Callers
// that own long-lived buffers (qvd bench, ZeRO's arenas) allocate through it where they can
// and fall back to make on an error: calls on such buffers skip the ring's copies.
type SharedAllocator interface {
	AllocShared(n int) ([]float32, error)
	FreeShared(buf []float32) error
}

// sharedOf finds t's SharedMemory extension, looking through wrappers (Count's) that
// expose what they wrap.
func sharedOf(t Transport) SharedMemory {
	for t != nil {
		if s, ok := t.(SharedMemory); ok {
			return s
		}
		u, ok := t.(interface{ Unwrap() Transport })
		if !ok {
			return nil
		}
		t = u.Unwrap()
	}
	return nil
}
