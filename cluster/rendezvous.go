package cluster

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// Rendezvous errors.
var (
	// ErrRendezvousTimeout: the world was not complete, or no roster came, in time.
	ErrRendezvousTimeout = errors.New("cluster: rendezvous timed out")
	// ErrWrongRole: Coordinate on a non-coordinator, AwaitRoster on a non-worker.
	ErrWrongRole = errors.New("cluster: wrong role for this operation")
)

// Coordinate runs the rendezvous of job on the coordinator. It waits until world live members
// are present — this node plus workers whose Meta.Job is "" or job, with a compatible version
// and a gRPC address (observers never count) — assigns ranks (this node 0, the others in
// order of node name; with more candidates than places, the first by name), and pushes the
// signed roster, with config and a fresh random data secret, to every member over gRPC in
// two phases (Prepare to all; once all accepted, Commit to all), so every rank holds the same
// roster before any starts. A member that fails Prepare makes the attempt start over with
// the membership as it then is. It gives up after Config.RendezvousTimeout (or when ctx
// ends) with an error wrapping ErrRendezvousTimeout that lists who is present and how many
// are missing. Workers must serve the control service (Register) on their Meta.GRPC address.
func (n *Node) Coordinate(ctx context.Context, job string, world int, config []byte) (*Roster, error) {
	if err := ValidJob(job); err != nil {
		return nil, fmt.Errorf("coordinate: %w", err)
	}
	if world < 1 || world > MaxWorld {
		return nil, fmt.Errorf("coordinate job %s: world size %d not in [1, %d]", job, world, MaxWorld)
	}
	if role := n.LocalMeta().Role; role != RoleCoordinator {
		return nil, fmt.Errorf("coordinate job %s: %w: %s has role %s, only a coordinator coordinates", job, ErrWrongRole, n.cfg.NodeName, role)
	}
	// Announce the job first, so that workers waiting for a roster can say whom they see.
	if err := n.UpdateMeta(func(m *Meta) { m.Job = job }); err != nil {
		return nil, fmt.Errorf("coordinate job %s: %w", job, err)
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, n.cfg.RendezvousTimeout)
	defer cancel()
	n.log.Info("rendezvous: waiting for members", zap.String("job", job), zap.Int("world", world))

	var lastErr error
	var lastGen uint64
	poll := time.NewTicker(n.cfg.Gossip.ProbeInterval)
	defer poll.Stop()
	for {
		changed := n.changedCh() // before looking, so no change is missed
		chosen, ineligible := n.candidates(job, world)
		if len(chosen) == world {
			gen := max(uint64(time.Now().UnixNano()), lastGen+1)
			lastGen = gen
			r, err := n.pushRoster(ctx, job, gen, chosen, config)
			if err == nil {
				if err := n.UpdateMeta(func(m *Meta) { m.Rank = 0 }); err != nil {
					return nil, fmt.Errorf("coordinate job %s: %w", job, err)
				}
				n.log.Info("rendezvous complete", zap.String("job", job), zap.Int("world", world), zap.Uint64("gen", gen), zap.Duration("took", time.Since(start)))
				return r, nil
			}
			lastErr = err
			if ctx.Err() == nil {
				n.log.Warn("rendezvous attempt failed; retrying with the current membership", zap.String("job", job), zap.Error(err))
				// Back off for a probe interval: the failure detector may be about to
				// remove the member that failed, and metadata updates (steps) must not
				// turn retries into a busy loop.
				backoff := time.NewTimer(n.cfg.Gossip.ProbeInterval)
				select {
				case <-backoff.C:
				case <-ctx.Done():
				case <-n.done:
				}
				backoff.Stop()
				continue
			}
		}
		select {
		case <-changed:
		case <-poll.C:
		case <-n.done:
			return nil, fmt.Errorf("coordinate job %s: %w", job, ErrClosed)
		case <-ctx.Done():
			chosen, ineligible = n.candidates(job, world)
			return nil, rendezvousTimeout(ctx, job, world, time.Since(start), chosen, ineligible, lastErr)
		}
	}
}

// candidates returns this node followed by up to world-1 eligible workers in rank order,
// and the other live members with the reason each does not count.
func (n *Node) candidates(job string, world int) (chosen []Member, ineligible []string) {
	local := n.LocalMeta()
	self := Member{Name: n.cfg.NodeName, Addr: n.LocalAddr(), State: StateAlive, Meta: local}
	var workers []Member
	for _, m := range n.Members() {
		if m.Name == n.cfg.NodeName {
			continue
		}
		why := ""
		switch {
		case m.Meta.Role != RoleWorker:
			why = "role " + m.Meta.Role
		case m.Meta.Job != "" && m.Meta.Job != job:
			why = "in job " + m.Meta.Job
		case !Compatible(m.Meta.Version, local.Version):
			why = "runs qvd " + m.Meta.Version
		case m.Meta.GRPC == "":
			why = "no gRPC address"
		}
		if why != "" {
			ineligible = append(ineligible, fmt.Sprintf("%s (%s): %s", m.Name, m.Addr, why))
			continue
		}
		workers = append(workers, m)
	}
	// Members() is sorted by name: ranks follow node names, the same on every run.
	chosen = append([]Member{self}, workers[:min(len(workers), world-1)]...)
	return chosen, ineligible
}

func rendezvousTimeout(ctx context.Context, job string, world int, took time.Duration, present []Member, ineligible []string, lastErr error) error {
	var b strings.Builder
	fmt.Fprintf(&b, "job %s: %d of %d members present after %v, %d missing; present:", job, len(present), world, took.Round(time.Millisecond), world-len(present))
	for i, m := range present {
		if i > 0 {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, " %s (%s)", m.Name, m.Addr)
	}
	if len(ineligible) > 0 {
		fmt.Fprintf(&b, "; not counted: %s", strings.Join(ineligible, ", "))
	}
	if lastErr != nil {
		fmt.Fprintf(&b, "; last attempt: %v", lastErr)
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		// The cause says why (a signal: "interrupted by SIGTERM"), where ctx.Err() would
		// only say "context canceled".
		return fmt.Errorf("coordinate: %w during rendezvous (%s)", context.Cause(ctx), b.String())
	}
	return fmt.Errorf("coordinate: %w: %s", ErrRendezvousTimeout, b.String())
}

// pushRoster makes the roster for chosen and runs the two phases. Each call to a member is
// bounded by twice gossip.tcp_timeout (and by ctx).
func (n *Node) pushRoster(ctx context.Context, job string, gen uint64, chosen []Member, config []byte) (*Roster, error) {
	return n.pushRosterWith(ctx, job, gen, chosen, config, pushOptions{callTimeout: 2 * n.cfg.Gossip.TCPTimeout, waitForReady: true})
}

// pushOptions tune pushRoster for a re-form (see Reform).
type pushOptions struct {
	callTimeout time.Duration
	// waitForReady: a member's server may still be starting (a first rendezvous), so a
	// refused connection is retried until callTimeout; false fails at once (re-forming
	// survivors' servers are up, and a refused connection means the process is gone).
	waitForReady bool
	// excluded, when set, receives the names that phase 1 found unreachable or that a
	// member's ack reported as suspects; the roster is then not committed.
	excluded func(names []string)
	// newcomers is how many of the last members are newcomers (a re-form admitting them):
	// suspicions name the old members' processes, so they never exclude a newcomer, which
	// may be a restarted process under a lost member's name.
	newcomers int
}

// errExcluded: a re-form attempt found members to leave out and did not commit.
var errExcluded = errors.New("members to leave out")

func (n *Node) pushRosterWith(ctx context.Context, job string, gen uint64, chosen []Member, config []byte, po pushOptions) (*Roster, error) {
	secret := make([]byte, secretLen)
	if _, err := rand.Read(secret); err != nil {
		return nil, fmt.Errorf("job %s: data secret: %w", job, err)
	}
	r := &Roster{Job: job, Gen: gen, World: len(chosen), Config: config, Secret: secret, Rank: 0}
	for _, m := range chosen {
		r.Members = append(r.Members, RosterMember{Name: m.Name, GRPC: m.Meta.GRPC, Data: m.Meta.Data, Gen: m.Meta.Gen, Host: m.Meta.Host})
	}
	msg, err := signRoster(n.keys, r)
	if err != nil {
		return nil, err
	}
	if len(chosen) == 1 {
		return r.Clone(), nil
	}

	conns := make([]*grpc.ClientConn, len(chosen))
	defer func() {
		for _, cc := range conns {
			if cc != nil {
				_ = cc.Close()
			}
		}
	}()
	for rank := 1; rank < len(chosen); rank++ {
		cc, err := grpc.NewClient(chosen[rank].Meta.GRPC, DialOptions(n.cfg.Key, n.cfg.TLS)...)
		if err != nil {
			return nil, fmt.Errorf("job %s: rank %d (%s at %s): %w", job, rank, chosen[rank].Name, chosen[rank].Meta.GRPC, err)
		}
		conns[rank] = cc
	}
	callTimeout := po.callTimeout
	ranks := make([]int, 0, len(chosen)-1)
	for rank := 1; rank < len(chosen); rank++ {
		ranks = append(ranks, rank)
	}

	// Phase 1: every member checks and holds the roster.
	var (
		smu      sync.Mutex
		suspects []string
	)
	failed := forEachRank(ctx, ranks, callTimeout, func(ctx context.Context, rank int) error {
		ack, err := callPrepareWith(ctx, conns[rank], msg, po.waitForReady)
		if err != nil {
			return n.explainTLS(chosen[rank].Meta.GRPC, err)
		}
		if ack.Name != chosen[rank].Name || ack.Rank != rank {
			return fmt.Errorf("answered as %s rank %d", ack.Name, ack.Rank)
		}
		smu.Lock()
		suspects = append(suspects, ack.Suspects...)
		smu.Unlock()
		return nil
	})
	if po.excluded != nil {
		var out []string
		for rank, m := range chosen {
			suspectable := rank > 0 && rank < len(chosen)-po.newcomers
			if _, bad := failed[rank]; bad || (suspectable && slices.Contains(suspects, m.Name)) {
				out = append(out, m.Name)
			}
		}
		if len(out) > 0 {
			po.excluded(out)
			desc := "reported gone by a member"
			if len(failed) > 0 {
				desc = describeFailures(chosen, failed)
			}
			return nil, fmt.Errorf("job %s gen %d: %w %v: %s", job, gen, errExcluded, out, desc)
		}
	}
	if len(failed) > 0 {
		return nil, fmt.Errorf("job %s gen %d: prepare refused or unanswered: %s", job, gen, describeFailures(chosen, failed))
	}

	// Phase 2: everyone holds it; release them. Commit is idempotent, so the members that
	// missed it are retried until the rendezvous deadline.
	commit := signCommit(n.keys, job, gen)
	for {
		failed := forEachRank(ctx, ranks, callTimeout, func(ctx context.Context, rank int) error {
			_, err := callCommit(ctx, conns[rank], commit)
			return err
		})
		if len(failed) == 0 {
			return r.Clone(), nil
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("job %s gen %d: commit not acknowledged: %s", job, gen, describeFailures(chosen, failed))
		}
		n.log.Warn("roster commit not acknowledged; retrying", zap.String("job", job), zap.String("failures", describeFailures(chosen, failed)))
		ranks = ranks[:0]
		for rank := range failed {
			ranks = append(ranks, rank)
		}
		t := time.NewTimer(n.cfg.Gossip.ProbeInterval)
		select {
		case <-t.C:
		case <-ctx.Done():
		}
		t.Stop()
	}
}

// forEachRank calls f for each rank in parallel, each under its own timeout, and returns
// the failures by rank.
func forEachRank(ctx context.Context, ranks []int, timeout time.Duration, f func(context.Context, int) error) map[int]error {
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		failed = make(map[int]error)
	)
	for _, rank := range ranks {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			if err := f(cctx, rank); err != nil {
				mu.Lock()
				failed[rank] = err
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return failed
}

func describeFailures(members []Member, failed map[int]error) string {
	ranks := make([]int, 0, len(failed))
	for rank := range failed {
		ranks = append(ranks, rank)
	}
	slices.Sort(ranks)
	parts := make([]string, len(ranks))
	for i, rank := range ranks {
		m := members[rank]
		parts[i] = fmt.Sprintf("rank %d (%s at %s): %v", rank, m.Name, m.Meta.GRPC, failed[rank])
	}
	return strings.Join(parts, "; ")
}

// AwaitRoster waits, on a worker, for a roster committed by a coordinator and newer than
// the last one this method returned; it then records the job and rank in this node's
// metadata. It gives up after Config.RendezvousTimeout (or when ctx ends) with an error
// wrapping ErrRendezvousTimeout that names the coordinators this node can see, if any.
func (n *Node) AwaitRoster(ctx context.Context) (*Roster, error) {
	if role := n.LocalMeta().Role; role != RoleWorker {
		return nil, fmt.Errorf("await roster: %w: %s has role %s, only workers await a roster", ErrWrongRole, n.cfg.NodeName, role)
	}
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, n.cfg.RendezvousTimeout)
	defer cancel()
	for {
		n.mu.Lock()
		st := &n.mu.roster
		var r *Roster
		if st.committed != nil && st.committed.Gen != st.delivered {
			st.delivered = st.committed.Gen
			r = st.committed.Clone()
		}
		ready := st.ready
		n.mu.Unlock()
		if r != nil {
			if err := n.UpdateMeta(func(m *Meta) { m.Job, m.Rank = r.Job, r.Rank }); err != nil {
				return nil, fmt.Errorf("await roster: %w", err)
			}
			return r, nil
		}
		select {
		case <-ready:
		case <-n.done:
			return nil, fmt.Errorf("await roster: %w", ErrClosed)
		case <-ctx.Done():
			return nil, n.awaitTimeout(ctx, time.Since(start))
		}
	}
}

func (n *Node) awaitTimeout(ctx context.Context, took time.Duration) error {
	var coords []string
	for _, m := range n.Members() {
		if m.Meta.Role == RoleCoordinator {
			job := m.Meta.Job
			if job == "" {
				job = "none yet"
			}
			coords = append(coords, fmt.Sprintf("%s (%s, job %s, qvd %s)", m.Name, m.Addr, job, m.Meta.Version))
		}
	}
	seen := "no coordinator is visible (is this node joined to the cluster that runs the job?)"
	if len(coords) > 0 {
		slices.Sort(coords)
		seen = "visible coordinators: " + strings.Join(coords, ", ")
	}
	if errors.Is(ctx.Err(), context.Canceled) {
		return fmt.Errorf("await roster on %s: %w during rendezvous after %v; %s", n.cfg.NodeName, context.Cause(ctx), took.Round(time.Millisecond), seen)
	}
	return fmt.Errorf("await roster on %s: %w: no roster after %v; %s", n.cfg.NodeName, ErrRendezvousTimeout, took.Round(time.Millisecond), seen)
}
