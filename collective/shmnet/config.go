package shmnet

import (
	"errors"
	"fmt"
	"time"
)

// Group names this rank's place among the ranks of one job on this host.
type Group struct {
	Job    string   // job id (cluster.ValidJob characters), part of segment names
	Rank   int      // this rank's index in the local group, 0..Size-1
	Size   int      // ranks in the local group
	Secret []byte   // per-job secret shared by the group (>= 16 bytes)
	Dir    string   // where segments live; "" = /dev/shm
	Addrs  []string // optional printable names of the peers for error messages (len Size or nil)
}

// DefaultDir is where segments live when Group.Dir is empty.
const DefaultDir = "/dev/shm"

const (
	// maxGroup bounds the local group: every rank maps every peer's segment, whose virtual
	// size grows with the group, and no host runs more ranks of one job than this.
	maxGroup = 256
	// minSecret is the shortest secret accepted, as for the cluster's hello MAC.
	minSecret = 16
	// maxJobLen is cluster.ValidJob's limit; names stay well under NAME_MAX (255).
	maxJobLen = 64
)

func (g Group) dir() string {
	if g.Dir == "" {
		return DefaultDir
	}
	return g.Dir
}

// validate checks the group; errors name the field.
func (g Group) validate() error {
	if err := validJob(g.Job); err != nil {
		return err
	}
	switch {
	case g.Size < 1 || g.Size > maxGroup:
		return fmt.Errorf("shmnet: group size %d, want 1 to %d", g.Size, maxGroup)
	case g.Rank < 0 || g.Rank >= g.Size:
		return fmt.Errorf("shmnet: rank %d outside a group of %d", g.Rank, g.Size)
	case len(g.Secret) < minSecret:
		return fmt.Errorf("shmnet: secret of %d bytes, want at least %d", len(g.Secret), minSecret)
	case g.Addrs != nil && len(g.Addrs) != g.Size:
		return fmt.Errorf("shmnet: %d addrs for a group of %d", len(g.Addrs), g.Size)
	}
	return nil
}

// validJob applies cluster.ValidJob's rule (this package does not import cluster, which
// would pull the control plane into the data plane): the job id becomes part of file names,
// so only letters, digits, '.', '_' and '-' are allowed.
func validJob(job string) error {
	if job == "" || len(job) > maxJobLen {
		return fmt.Errorf("shmnet: job id %q must be 1 to %d characters", job, maxJobLen)
	}
	for _, r := range job {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("shmnet: job id %q may only contain letters, digits, '.', '_' and '-'", job)
		}
	}
	return nil
}

// Config tunes the shared-memory data plane.
type Config struct {
	// RingBytes is the size of the byte ring of each directed pair of ranks (the receiver's
	// segment holds one per peer, but only the pages of rings in use are ever touched). A
	// power of two; frames larger than the ring are streamed through it.
	RingBytes int
	// AttachTimeout bounds New: how long it waits for every peer's segment to appear and
	// for every peer to attach to this rank's.
	AttachTimeout time.Duration
	// Spin is how long a Send or Recv that must wait polls the ring (yielding the processor
	// between polls) before it sleeps on the futex. Waking a sleeper costs a system call on
	// each side and a few microseconds; spinning longer than a frame takes to copy wastes a
	// core that a peer may need. 0 sleeps at once.
	//
	// It applies also where the ranks outnumber the processors. Sleeping at once there (the
	// earlier rule: the peer a spinner waits for may be the one it keeps off the processor)
	// ran a 64 MiB all-reduce of 4 ranks on 2 cores no faster (qvd bench, 2026-11-25: ~5.2
	// GB/s busbw either way), while training, whose steps are many small reductions between
	// compute, lost most of its time to futex wake-ups: the shipped MLP as 4 ranks on 2 cores
	// ran 7,300-8,000 samples/s sleeping at once against 12,900-13,200 spinning 50 µs, the
	// 36.8M MLP at stage 2 0.62-0.73 s per step against 0.55-0.60.
	Spin time.Duration
	// PollInterval is the futex sleep's timeout: how often a sleeping Send or Recv checks its
	// context and whether the peer still holds its segment's lock (is alive). A peer killed with SIGKILL is
	// reported within about this long.
	PollInterval time.Duration
	// ArenaBytes is the address space of this rank's shared arena, from which
	// collective.SharedMemory's AllocShared hands out buffers that the peers read in place
	// (collective calls on them skip the rings). It costs no memory until allocated: the
	// arena is a hole in the segment file, and each buffer reserves its pages (fallocate)
	// when allocated and releases them when freed. Every peer maps it, so a rank reserves
	// Size × ArenaBytes of address space. 0: no arena. A multiple of 4096.
	ArenaBytes int64
}

// DefaultConfig: 1 MiB rings, 30 s to attach, 50 µs of spinning, 20 ms polls, a 16 GiB
// arena (address space only: a model's gradients and their staging fit). 1 MiB
// rings (two 512 KiB ring pieces) stay in a core's L2 and cost 10–25% less CPU per
// all-reduce than 4 MiB ones; spinning 10–50 µs before sleeping cost a quarter less CPU
// than sleeping at once with 4 ranks on 2 cores (BenchmarkSpin, see doc.go).
func DefaultConfig() Config {
	return Config{
		RingBytes:     1 << 20,
		AttachTimeout: 30 * time.Second,
		Spin:          50 * time.Microsecond,
		PollInterval:  20 * time.Millisecond,
		ArenaBytes:    16 << 30,
	}
}

const (
	minRing = 64 << 10
	maxRing = 1 << 30
	// maxArena bounds the arena: Size × maxArena of address space per rank stays far below
	// the 128 TiB of a 47-bit user address space for groups up to maxGroup.
	maxArena = 64 << 30
)

// Validate checks the fields; errors name the field and the allowed range.
func (c Config) Validate() error {
	switch {
	case c.RingBytes < minRing || c.RingBytes > maxRing || c.RingBytes&(c.RingBytes-1) != 0:
		return fmt.Errorf("ring_bytes: must be a power of two between %d and %d, got %d", minRing, maxRing, c.RingBytes)
	case c.AttachTimeout < 10*time.Millisecond || c.AttachTimeout > 10*time.Minute:
		return fmt.Errorf("attach_timeout: must be between 10ms and 10m, got %v", c.AttachTimeout)
	case c.Spin < 0 || c.Spin > 10*time.Millisecond:
		return fmt.Errorf("spin: must be between 0 and 10ms, got %v", c.Spin)
	case c.PollInterval < time.Millisecond || c.PollInterval > time.Second:
		return fmt.Errorf("poll_interval: must be between 1ms and 1s, got %v", c.PollInterval)
	case c.ArenaBytes < 0 || c.ArenaBytes > maxArena || c.ArenaBytes%pageBytes != 0:
		return fmt.Errorf("arena_bytes: must be a multiple of %d between 0 and %d, got %d", pageBytes, int64(maxArena), c.ArenaBytes)
	}
	return nil
}

// pageBytes is the arena's granularity (config.go is built everywhere; segment.go's
// pageSize only on Linux).
const pageBytes = 4096

// errUnsupported is returned off Linux.
var errUnsupported = errors.New("shmnet: the shared-memory transport needs Linux (futex, flock on tmpfs)")
