package collective

import (
	"errors"
	"fmt"
	"sync"
)

// Roster is one job's group as the control plane hands it to a rank: what a network
// transport (tcpnet, grpcnet) needs to reach its peers and to prove and check membership.
type Roster struct {
	Job    string   // job id; part of the authentication
	Rank   int      // this process's rank
	Addrs  []string // address of every rank (index = rank), host:port; this rank's may be empty
	Secret []byte   // the job's shared secret; connections must prove it
}

// Validate checks the roster; errors name the field. Ranks travel as uint16 in hellos and
// frame headers, which bounds the group.
func (g Roster) Validate() error {
	switch {
	case g.Job == "":
		return errors.New("job: must not be empty")
	case len(g.Addrs) == 0 || len(g.Addrs) > maxRanks:
		return fmt.Errorf("addrs: must list 1 to %d ranks, got %d", maxRanks, len(g.Addrs))
	case g.Rank < 0 || g.Rank >= len(g.Addrs):
		return fmt.Errorf("rank: must be in [0, %d), got %d", len(g.Addrs), g.Rank)
	case len(g.Secret) == 0:
		return errors.New("secret: must not be empty")
	}
	for r, a := range g.Addrs {
		if a == "" && r != g.Rank {
			return fmt.Errorf("addrs[%d]: empty address", r)
		}
	}
	return nil
}

// Jobs is the per-job registry of transports that a process's listener (tcpnet) or stream
// hub (grpcnet) keeps: an incoming connection names or proves its job and is handed to that
// job's transport. A connection may arrive before its job registers (a peer learnt the roster
// first), so every registration wakes the waiters (Changed). One transport per job. The zero
// value is ready; all methods are safe for concurrent use.
type Jobs[T comparable] struct {
	mu      sync.Mutex
	closed  bool
	byJob   map[string]T
	changed chan struct{} // closed and replaced at every registration
}

// ErrJobRegistered: the job already has a transport in this registry.
var ErrJobRegistered = errors.New("collective: the job already has a transport here")

// changedLocked is the channel the next registration closes.
func (j *Jobs[T]) changedLocked() chan struct{} {
	if j.changed == nil {
		j.changed = make(chan struct{})
	}
	return j.changed
}

// Register adds t as job's transport and wakes the waiters. It fails with ErrClosed once the
// registry is closed, and with ErrJobRegistered if job has a transport already.
func (j *Jobs[T]) Register(job string, t T) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return ErrClosed
	}
	if _, dup := j.byJob[job]; dup {
		return ErrJobRegistered
	}
	if j.byJob == nil {
		j.byJob = make(map[string]T)
	}
	j.byJob[job] = t
	close(j.changedLocked())
	j.changed = make(chan struct{})
	return nil
}

// Unregister removes job's transport if it is t (a transport closing).
func (j *Jobs[T]) Unregister(job string, t T) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if cur, ok := j.byJob[job]; ok && cur == t {
		delete(j.byJob, job)
	}
}

// Get returns job's transport (ok false if none), whether the registry is closed, and a
// channel closed at the next registration, to wait on before asking again.
func (j *Jobs[T]) Get(job string) (t T, ok, closed bool, changed <-chan struct{}) {
	j.mu.Lock()
	defer j.mu.Unlock()
	t, ok = j.byJob[job]
	return t, ok, j.closed, j.changedLocked()
}

// All returns the registered transports (in no order), whether the registry is closed, and a
// channel closed at the next registration: for a connection that proves its job rather than
// naming it, checked against each.
func (j *Jobs[T]) All() (ts []T, closed bool, changed <-chan struct{}) {
	j.mu.Lock()
	defer j.mu.Unlock()
	ts = make([]T, 0, len(j.byJob))
	for _, t := range j.byJob {
		ts = append(ts, t)
	}
	return ts, j.closed, j.changedLocked()
}

// Close refuses registrations from now on and returns the transports registered, for the
// caller to close (they unregister themselves); nil the second time.
func (j *Jobs[T]) Close() []T {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.closed {
		return nil
	}
	j.closed = true
	ts := make([]T, 0, len(j.byJob))
	for _, t := range j.byJob {
		ts = append(ts, t)
	}
	return ts
}
