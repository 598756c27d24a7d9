package job

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
)

// membership is the job's elastic membership: Options.Membership, or the cluster member's
// (gossip and the rendezvous); nil for a fixed-size job.
func (j *job) membership() Membership {
	switch {
	case !j.cfg.Elastic.Enabled():
		return nil
	case j.mem != nil:
		return j.mem
	case j.member != nil:
		return &clusterMembership{j: j}
	}
	return nil
}

// clusterMembership re-forms a job over its cluster member: gossip tells who is alive and who
// waits to join, the lowest-ranked survivor coordinates the next generation
// (cluster.Node.Reform, which admits the newcomers), the others — survivors and newcomers —
// await its roster, and every survivor builds the next data plane.
type clusterMembership struct{ j *job }

var _ Membership = (*clusterMembership)(nil)

func (c *clusterMembership) Watch(lost func(error)) func() {
	stop := make(chan struct{})
	c.j.member.watchPeers(c.j.roster, lost, stop)
	var once sync.Once
	return func() { once.Do(func() { close(stop) }) }
}

func (c *clusterMembership) Newcomers() int { return len(c.j.member.node.Newcomers(c.j.roster)) }

func (c *clusterMembership) Reform(ctx context.Context, cause error, min, max int, wait time.Duration) (Generation, error) {
	j, m, prev := c.j, c.j.member, c.j.roster
	gone := goneMembers(cause, prev)
	// Reported in this member's Prepare acks: the coordinator leaves them out at once.
	m.node.Suspect(prev.Job, prev.Gen, gone)
	deadline := time.Now().Add(wait)
	rdv, cancel := context.WithTimeout(ctx, m.node.RendezvousTimeout())
	defer cancel()
	var r *cluster.Roster
	for r == nil {
		alive := m.node.SurvivorsExcept(rdv, prev, gone)
		// Below min_nodes the group waits for members: survivors, or newcomers (a restarted
		// worker) that the coordinator admits with them.
		if len(alive)+len(m.node.Newcomers(prev)) < min {
			if !time.Now().Before(deadline) {
				return Generation{}, fmt.Errorf("%d of %d members remain, fewer than elastic.min_nodes %d, after waiting %v (elastic.rejoin_timeout): %w",
					len(alive), prev.World, min, wait, cause)
			}
			if err := sleepCtx(ctx, time.Second); err != nil {
				return Generation{}, fmt.Errorf("%w (while waiting for members: %w)", cause, err)
			}
			continue
		}
		var err error
		if alive[0] == m.node.LocalName() {
			r, err = m.node.Reform(rdv, prev, gone, max)
		} else {
			// The coordinator is the lowest-ranked survivor; when it turns out gone meanwhile
			// (gossip declares it dead), this member may coordinate instead.
			poll, stop := context.WithTimeout(rdv, coordinatorPoll)
			r, err = m.node.AwaitRoster(poll)
			stop()
			if err != nil && rdv.Err() == nil && ctx.Err() == nil && errors.Is(err, cluster.ErrRendezvousTimeout) {
				err = nil
			}
		}
		if err != nil {
			return Generation{}, fmt.Errorf("re-forming after %v: %w", cause, err)
		}
		if r == nil && rdv.Err() != nil {
			return Generation{}, fmt.Errorf("re-forming after %v: %w: no roster after %v", cause, cluster.ErrRendezvousTimeout, m.node.RendezvousTimeout())
		}
	}
	if r.Job != prev.Job || r.Gen <= prev.Gen {
		return Generation{}, fmt.Errorf("re-forming after %v: got the roster of job %s gen %d, want job %s after gen %d", cause, r.Job, r.Gen, prev.Job, prev.Gen)
	}
	if err := j.attach(ctx, m, r); err != nil {
		return Generation{}, fmt.Errorf("re-forming: %w", err)
	}
	return Generation{Gen: r.Gen, Rank: r.Rank, World: r.World, Comm: j.comm, Dead: m.node.Dead(ctx, j.trained, r)}, nil
}

// coordinatorPoll is how often a survivor that awaits the roster checks whether gossip has
// made it the coordinator (the coordinator it awaited was lost): about a gossip probe.
const coordinatorPoll = 250 * time.Millisecond

// goneMembers names the members of prev that cause shows gone: one gossip declared failed,
// or one a collective found its connection to lost (collective.ErrPeerGone: the process
// exited or was killed). A collective's timeout names no one: the rank that timed out may
// only have been waiting on a slower one, and a merely slow member is left to the
// coordinator's own deadline (see cluster.Node.Reform).
func goneMembers(cause error, prev *cluster.Roster) []string {
	var out []string
	var mf *memberFailed
	if errors.As(cause, &mf) && prev.RankOf(mf.name) >= 0 {
		out = append(out, mf.name)
	}
	var pe *collective.PeerError
	if errors.As(cause, &pe) && errors.Is(pe.Err, collective.ErrPeerGone) && pe.Rank >= 0 && pe.Rank < len(prev.Members) && pe.Rank != prev.Rank {
		if name := prev.Members[pe.Rank].Name; !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}

// sleepCtx waits d or until ctx ends, returning its cause.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// genJob names generation gen's data plane of job: the job id with a suffix, shortened to a
// hash where it would exceed a job id's 64 characters (as crossJob).
func genJob(job string, gen uint64) string {
	suffix := ".g" + strconv.FormatUint(gen%1_000_000, 10)
	if len(job)+len(suffix) > 64 {
		sum := sha256.Sum256([]byte(job))
		job = hex.EncodeToString(sum[:16])
	}
	return job + suffix
}
