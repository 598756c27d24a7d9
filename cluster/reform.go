package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sync"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// Elastic re-forming. After a job loses members, its survivors form the next generation
// without them: the coordinator of generation prev.Gen+1 is the lowest-ranked member of prev
// still alive — rank 0 while it lives, whatever its role — so every survivor that sees the
// same live members picks the same one without an election. It pushes the roster to the
// others through the same two phases as Coordinate; they take it with AwaitRoster. Ranks
// follow the old ranks' order. A member counts as alive only as the same process (its
// Meta.Gen): one restarted under the same name is a newcomer. Newcomers — workers that joined
// the cluster and wait for a roster of this job (Newcomers) — are admitted after the
// survivors, up to the job's largest world: a job grows the same way it shrinks, by a
// re-form at a step boundary.

// Survivors returns the names of prev's members that gossip reports alive as the same
// processes, this node included, in prev's rank order.
func (n *Node) Survivors(prev *Roster) []string {
	live := map[string]Member{}
	for _, m := range n.Members() {
		live[m.Name] = m
	}
	var out []string
	for _, rm := range prev.Members {
		if rm.Name == n.cfg.NodeName {
			out = append(out, rm.Name)
			continue
		}
		if m, ok := live[rm.Name]; ok && m.State == StateAlive && m.Meta.Gen == rm.Gen {
			out = append(out, rm.Name)
		}
	}
	return out
}

// reformCallTimeout bounds each call of a re-form to a member. Re-forming survivors' servers
// are up and answer Prepare from memory in milliseconds; a member that cannot answer within
// it (stopped, swapping, cut off) is left out of the generation rather than holding every
// survivor for the first rendezvous's 2 × gossip.tcp_timeout (10 s by default).
const reformCallTimeout = 2 * time.Second

// suspicion is what a member reports, in its Prepare acks, to the coordinator re-forming
// the job after generation gen.
type suspicion struct {
	job   string
	gen   uint64
	names []string
}

// Suspect records that this member's own collectives in generation gen of job found the
// named members gone. It answers the Prepare of any later generation of that job with them,
// and the coordinator leaves them out: a survivor's evidence excludes a member at once, for
// every survivor, before gossip declares it dead.
func (n *Node) Suspect(job string, gen uint64, names []string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	s := &n.mu.suspects
	if s.job != job || s.gen != gen {
		*s = suspicion{job: job, gen: gen}
	}
	for _, name := range names {
		if !slices.Contains(s.names, name) {
			s.names = append(s.names, name)
		}
	}
}

// SurvivorsExcept is Survivors without the members of gone — those this member's own
// evidence shows gone — whose gRPC address refuses a connection, which a process that
// serves never does: so a lost coordinator is replaced as soon as its successor finds it
// gone, rather than when gossip declares it dead, and survivors whose evidence differs still
// agree on the coordinator (a member that answers, or is only slow, stays in).
func (n *Node) SurvivorsExcept(ctx context.Context, prev *Roster, gone []string) []string {
	alive := n.Survivors(prev)
	out := alive[:0:0]
	for _, name := range alive {
		if name != n.cfg.NodeName && slices.Contains(gone, name) {
			if i := prev.RankOf(name); i >= 0 && refuses(ctx, prev.Members[i].GRPC) {
				continue
			}
		}
		out = append(out, name)
	}
	return out
}

// Dead returns the ranks of prev's members outside next (the generation that replaced it)
// whose process is known to have ended, not merely to be out of reach: its gRPC address
// refuses connections (a host that is cut off, or a stopped process, does not refuse), or a
// live member now carries its name as another process (a restart). A partition's other side
// is never among them, so the survivors may leave them out of the quorum (elastic.Decide).
func (n *Node) Dead(ctx context.Context, prev, next *Roster) []int {
	live := map[string]Member{}
	for _, m := range n.Members() {
		live[m.Name] = m
	}
	var (
		mu   sync.Mutex
		dead []int
		wg   sync.WaitGroup
	)
	for rank, rm := range prev.Members {
		if next.RankOf(rm.Name) >= 0 && next.Members[next.RankOf(rm.Name)].Gen == rm.Gen {
			continue
		}
		if m, ok := live[rm.Name]; ok && m.State == StateAlive && m.Meta.Gen != rm.Gen {
			dead = append(dead, rank)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if refuses(ctx, rm.GRPC) {
				mu.Lock()
				dead = append(dead, rank)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	slices.Sort(dead)
	return dead
}

// refuses reports whether a TCP connection to addr is refused (within refuseProbe).
func refuses(ctx context.Context, addr string) bool {
	ctx, cancel := context.WithTimeout(ctx, refuseProbe)
	defer cancel()
	c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
	if err == nil {
		c.Close()
		return false
	}
	return errors.Is(err, syscall.ECONNREFUSED)
}

// refuseProbe bounds refuses: a refusal comes back in one round trip.
const refuseProbe = 500 * time.Millisecond

// Reform runs the rendezvous of generation prev.Gen+1 of prev's job on its coordinator, the
// lowest-ranked of SurvivorsExcept(prev, exclude), which must be this node. The roster
// names the survivors in their old order (this node rank 0), then the Newcomers while the
// world is below maxWorld, with prev's config and a fresh data secret, leaving out the members in exclude (this node's own evidence), those a
// member's Prepare ack reports gone (Suspect) and those that do not answer Prepare within
// reformCallTimeout; the roster it commits is what every survivor then follows. An attempt
// that leaves someone out is retried at once without them; one that fails otherwise is
// retried after a probe interval. It gives up after Config.RendezvousTimeout with an error
// wrapping ErrRendezvousTimeout. The other survivors call AwaitRoster.
func (n *Node) Reform(ctx context.Context, prev *Roster, exclude []string, maxWorld int) (*Roster, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, n.cfg.RendezvousTimeout)
	defer cancel()
	gen := prev.Gen + 1
	out := slices.Clone(exclude)
	var refused []uint64 // newcomers (by Meta.Gen) that did not answer this re-form
	for {
		alive := n.SurvivorsExcept(ctx, prev, exclude)
		if alive[0] != n.cfg.NodeName {
			return nil, fmt.Errorf("re-form job %s: %s does not coordinate generation %d (the lowest-ranked survivor does: %v)", prev.Job, n.cfg.NodeName, gen, alive)
		}
		live := map[string]Member{}
		for _, m := range n.Members() {
			live[m.Name] = m
		}
		chosen := []Member{{Name: n.cfg.NodeName, Addr: n.LocalAddr(), State: StateAlive, Meta: n.LocalMeta()}}
		for _, name := range alive[1:] {
			if !slices.Contains(out, name) {
				chosen = append(chosen, live[name])
			}
		}
		// Newcomers are told apart from the survivors by process (Meta.Gen), not by name:
		// a lost member restarted under its name is one, though its name is in out.
		survivors := len(chosen)
		for _, m := range n.Newcomers(prev) {
			if len(chosen) >= maxWorld {
				break
			}
			if !slices.Contains(refused, m.Meta.Gen) && !slices.ContainsFunc(chosen, func(c Member) bool { return c.Name == m.Name }) {
				chosen = append(chosen, m)
			}
		}
		left := false
		r, err := n.pushRosterWith(ctx, prev.Job, gen, chosen, prev.Config, pushOptions{
			callTimeout: reformCallTimeout,
			newcomers:   len(chosen) - survivors,
			excluded: func(names []string) {
				n.log.Warn("re-form leaves out members that are gone or do not answer", zap.String("job", prev.Job), zap.Uint64("gen", gen), zap.Strings("members", names))
				for i, m := range chosen {
					switch {
					case !slices.Contains(names, m.Name):
					case i >= survivors:
						refused = append(refused, m.Meta.Gen)
					default:
						out = append(out, m.Name)
					}
				}
				left = true
			},
		})
		if err == nil {
			if err := n.UpdateMeta(func(m *Meta) { m.Rank = 0 }); err != nil {
				return nil, fmt.Errorf("re-form job %s: %w", prev.Job, err)
			}
			n.log.Info("re-formed", zap.String("job", prev.Job), zap.Uint64("gen", gen), zap.Int("world", len(chosen)), zap.Duration("took", time.Since(start)))
			return r, nil
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("re-form job %s: %w: %w", prev.Job, ErrRendezvousTimeout, err)
		}
		if left {
			continue
		}
		// A survivor may still be failing its last collective: retry after a probe interval.
		n.log.Warn("re-form attempt failed; retrying", zap.String("job", prev.Job), zap.Error(err))
		t := time.NewTimer(n.cfg.Gossip.ProbeInterval)
		select {
		case <-t.C:
		case <-ctx.Done():
		case <-n.done:
			t.Stop()
			return nil, fmt.Errorf("re-form job %s: %w", prev.Job, ErrClosed)
		}
		t.Stop()
	}
}

// Newcomers returns the live members that may join prev's job at its next generation, in
// name order: workers (never observers or coordinators) of a compatible version with a gRPC
// address, that belong to no job or to this one, hold no rank, and are not members of prev as
// the same process — a member restarted under its old name is a newcomer. A process that
// holds a rank is in a generation or was left out of one (killed, but not yet declared dead
// by gossip; or stopped, which exits when it resumes), never a newcomer.
func (n *Node) Newcomers(prev *Roster) []Member {
	local := n.LocalMeta()
	var out []Member
	for _, m := range n.Members() {
		if m.Name == n.cfg.NodeName || m.State != StateAlive || m.Meta.Role != RoleWorker || m.Meta.GRPC == "" || m.Meta.Rank >= 0 ||
			(m.Meta.Job != "" && m.Meta.Job != prev.Job) || !Compatible(m.Meta.Version, local.Version) {
			continue
		}
		if i := prev.RankOf(m.Name); i >= 0 && prev.Members[i].Gen == m.Meta.Gen {
			continue
		}
		out = append(out, m)
	}
	return out
}

// RendezvousTimeout is Config.RendezvousTimeout: how long Reform and AwaitRoster wait.
func (n *Node) RendezvousTimeout() time.Duration { return n.cfg.RendezvousTimeout }
