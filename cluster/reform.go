package cluster

import (
	"context"
	"fmt"
	"time"

	"go.uber.org/zap"
)

// Elastic re-forming. After a job loses members, its survivors form the next generation
// without them: the coordinator of generation prev.Gen+1 is the lowest-ranked member of prev
// still alive — rank 0 while it lives, whatever its role — so every survivor that sees the
// same live members picks the same one without an election. It pushes the roster to the
// others through the same two phases as Coordinate; they take it with AwaitRoster. Ranks
// follow the old ranks' order. A member counts as alive only as the same process (its
// Meta.Gen): one restarted under the same name is a newcomer, which this increment does not
// admit.

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

// Reform runs the rendezvous of generation prev.Gen+1 of prev's job on its coordinator, the
// lowest-ranked of prev's Survivors, which must be this node: the roster names the survivors
// in their old order (this node rank 0), with prev's config and a fresh data secret. An
// attempt that a member fails (the failure detector had not yet declared it dead) is retried
// with the survivors as they then are. It gives up after Config.RendezvousTimeout with an
// error wrapping ErrRendezvousTimeout. The other survivors call AwaitRoster.
func (n *Node) Reform(ctx context.Context, prev *Roster) (*Roster, error) {
	start := time.Now()
	ctx, cancel := context.WithTimeout(ctx, n.cfg.RendezvousTimeout)
	defer cancel()
	gen := prev.Gen + 1
	for {
		alive := n.Survivors(prev)
		if alive[0] != n.cfg.NodeName {
			return nil, fmt.Errorf("re-form job %s: %s does not coordinate generation %d (the lowest-ranked survivor does: %v)", prev.Job, n.cfg.NodeName, gen, alive)
		}
		live := map[string]Member{}
		for _, m := range n.Members() {
			live[m.Name] = m
		}
		chosen := []Member{{Name: n.cfg.NodeName, Addr: n.LocalAddr(), State: StateAlive, Meta: n.LocalMeta()}}
		for _, name := range alive[1:] {
			chosen = append(chosen, live[name])
		}
		r, err := n.pushRoster(ctx, prev.Job, gen, chosen, prev.Config)
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
