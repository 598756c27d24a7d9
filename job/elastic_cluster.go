package job

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/qvd/qvd/cluster"
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

// clusterMembership re-forms a job over its cluster member: gossip tells who is alive, the
// lowest-ranked survivor coordinates the next generation (cluster.Node.Reform), the others
// await its roster, and every survivor builds the next data plane.
type clusterMembership struct{ j *job }

var _ Membership = (*clusterMembership)(nil)

func (c *clusterMembership) Watch(lost func(error)) func() {
	stop := make(chan struct{})
	c.j.member.watchPeers(c.j.roster, lost, stop)
	var once sync.Once
	return func() { once.Do(func() { close(stop) }) }
}

func (c *clusterMembership) Reform(ctx context.Context, cause error, min int, wait time.Duration) (Generation, error) {
	j, m, prev := c.j, c.j.member, c.j.roster
	deadline := time.Now().Add(wait)
	alive := m.node.Survivors(prev)
	for len(alive) < min {
		if !time.Now().Before(deadline) {
			return Generation{}, fmt.Errorf("%d of %d members remain, fewer than elastic.min_nodes %d, after waiting %v (elastic.rejoin_timeout): %w",
				len(alive), prev.World, min, wait, cause)
		}
		t := time.NewTimer(time.Second)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return Generation{}, fmt.Errorf("%w (while waiting for members: %w)", cause, context.Cause(ctx))
		}
		alive = m.node.Survivors(prev)
	}
	var r *cluster.Roster
	var err error
	if alive[0] == m.node.LocalName() {
		r, err = m.node.Reform(ctx, prev)
	} else {
		r, err = m.node.AwaitRoster(ctx)
	}
	if err != nil {
		return Generation{}, fmt.Errorf("re-forming after %v: %w", cause, err)
	}
	if r.Job != prev.Job || r.Gen <= prev.Gen {
		return Generation{}, fmt.Errorf("re-forming after %v: got the roster of job %s gen %d, want job %s after gen %d", cause, r.Job, r.Gen, prev.Job, prev.Gen)
	}
	// The new data plane is named apart from the old one, whose transports may still be
	// draining on the shared listeners.
	dr := r.Clone()
	dr.Job = genJob(r.Job, r.Gen)
	if err := j.attach(ctx, m, dr); err != nil {
		return Generation{}, fmt.Errorf("re-forming: %w", err)
	}
	// attach published the data plane's name as this member's job: put the job's back.
	_ = m.node.UpdateMeta(func(meta *cluster.Meta) { meta.Job = r.Job })
	j.roster = r
	return Generation{Gen: r.Gen, Rank: r.Rank, World: r.World, Comm: j.comm}, nil
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
