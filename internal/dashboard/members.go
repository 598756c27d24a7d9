package dashboard

import (
	"cmp"
	"context"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/internal/metrics"
)

// StateMissing is a member this view saw before and no longer sees, without an event that
// says whether it left or failed (a view that does not own the node's Events).
const StateMissing = "missing"

// MemberSource is a live view of the cluster's members: the page's member table and
// per-rank memory when there is one (`qvd dashboard PEER`, or `qvd train --dashboard-addr`
// on a multi-node job's rank 0).
type MemberSource interface {
	Members() []metrics.Member
}

// ClusterView is a MemberSource over a cluster.Node: the live members from gossip, and the
// members it saw that are gone, with memberlist's verdict (dead or left) when it reads the
// node's Events, else StateMissing. Observers (qvd status, other dashboards) are left out.
// Safe for concurrent use.
type ClusterView struct {
	node *cluster.Node
	job  string // "": every job's members
	// ctx ends at Close: it stops the view's goroutines and a join in progress.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu struct {
		sync.Mutex
		seen map[string]metrics.Member // every member seen, by name, with its last figures
		gone map[string]string         // departed members: name → dead or left
	}
}

var _ MemberSource = (*ClusterView)(nil)

// ViewOptions configure a ClusterView.
type ViewOptions struct {
	// WatchEvents makes the view read the node's Events to tell dead members from those that
	// left: only where nothing else reads them (the channel has one reader; a training job's
	// rank watches it for lost peers).
	WatchEvents bool
	// Job, if set, keeps only that job's members (rank 0's view of its own job; a gossip
	// cluster can hold several jobs, each with its own ranks).
	Job string
	// Rejoin, if set, is a gossip address the view joins again whenever it finds no live
	// member, checking every RejoinEvery: an observer whose cluster was restarted at the same
	// address (a job resumed after a failure) follows it rather than showing the old members
	// dead.
	Rejoin      string
	RejoinEvery time.Duration
}

// DefaultRejoinEvery: how long a view without live members waits between joins.
const DefaultRejoinEvery = 5 * time.Second

// NewClusterView returns a view of n's members. Close stops what it runs in the background.
func NewClusterView(n *cluster.Node, o ViewOptions) *ClusterView {
	v := &ClusterView{node: n, job: o.Job}
	v.ctx, v.cancel = context.WithCancel(context.Background())
	v.mu.seen = map[string]metrics.Member{}
	v.mu.gone = map[string]string{}
	if o.WatchEvents {
		v.wg.Add(1)
		go v.watch()
	}
	if o.Rejoin != "" {
		v.wg.Add(1)
		go v.rejoin(o.Rejoin, cmp.Or(o.RejoinEvery, DefaultRejoinEvery))
	}
	return v
}

// rejoin joins peer again each time a period passes with no live member in view. A failed
// join is tried again a period later: the cluster may not be up yet.
func (v *ClusterView) rejoin(peer string, every time.Duration) {
	defer v.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-v.ctx.Done():
			return
		case <-t.C:
		}
		if slices.ContainsFunc(v.Members(), func(m metrics.Member) bool { return m.State == cluster.StateAlive }) {
			continue
		}
		ctx, cancel := context.WithTimeout(v.ctx, every)
		_ = v.node.Join(ctx, peer) // nothing to report to: the page shows who is there
		cancel()
	}
}

func (v *ClusterView) watch() {
	defer v.wg.Done()
	for {
		select {
		case <-v.ctx.Done():
			return
		case ev, ok := <-v.node.Events():
			if !ok {
				return
			}
			v.mu.Lock()
			switch ev.Kind {
			case cluster.Failed:
				v.mu.gone[ev.Member.Name] = cluster.StateDead
			case cluster.Left:
				v.mu.gone[ev.Member.Name] = cluster.StateLeft
			case cluster.Joined:
				delete(v.mu.gone, ev.Member.Name) // back under the same name (a restart)
			}
			v.mu.Unlock()
		}
	}
}

// Close stops the view's goroutines (reading events, rejoining) and waits for them; safe to
// call twice. It does not close the node.
func (v *ClusterView) Close() {
	v.cancel()
	v.wg.Wait()
}

// Members returns the members with a role other than observer, ranked ones by rank first,
// then the others by name; those gone last, by name.
func (v *ClusterView) Members() []metrics.Member {
	live := v.node.Members()
	self, selfMeta := v.node.LocalName(), v.node.LocalMeta()
	v.mu.Lock()
	defer v.mu.Unlock()
	alive := map[string]bool{}
	var out []metrics.Member
	for _, m := range live {
		if m.Name == self {
			m.Meta = selfMeta // our own latest figures, before gossip carries them
		}
		if m.Meta.Role == cluster.RoleObserver || (v.job != "" && m.Meta.Job != v.job) {
			continue
		}
		mm := fromCluster(m)
		alive[m.Name] = true
		delete(v.mu.gone, m.Name)
		v.mu.seen[m.Name] = mm
		out = append(out, mm)
	}
	for name, mm := range v.mu.seen {
		if alive[name] {
			continue
		}
		mm.State = cmp.Or(v.mu.gone[name], StateMissing)
		out = append(out, mm)
	}
	SortMembers(out)
	return out
}

func fromCluster(m cluster.Member) metrics.Member {
	return metrics.Member{Name: m.Name, State: m.State, Role: m.Meta.Role, Job: m.Meta.Job, Rank: m.Meta.Rank, Step: m.Meta.Step, Gen: m.Meta.Gen,
		Model: m.Meta.ModelBytes, RSS: m.Meta.RSS, Peak: m.Meta.Peak}
}

// SortMembers orders members as the page lists them: live before gone, by job, ranked by
// rank, then the rest by name.
func SortMembers(ms []metrics.Member) {
	goneRank := func(m metrics.Member) int {
		if m.State == cluster.StateAlive || m.State == cluster.StateSuspect {
			return 0
		}
		return 1
	}
	slices.SortStableFunc(ms, func(a, b metrics.Member) int {
		if c := cmp.Compare(goneRank(a), goneRank(b)); c != 0 {
			return c
		}
		if c := strings.Compare(a.Job, b.Job); c != 0 {
			return c
		}
		switch {
		case a.Rank >= 0 && b.Rank >= 0 && a.Rank != b.Rank:
			return cmp.Compare(a.Rank, b.Rank)
		case a.Rank >= 0 && b.Rank < 0:
			return -1
		case a.Rank < 0 && b.Rank >= 0:
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
}

// MembersLog decides when rank 0 writes a members record to the metrics file, so that
// `qvd dashboard RUN_DIR` shows the members a multi-node run had: whenever the members'
// names, ranks or states change, and otherwise at most once per Every (for their steps and
// memory). Not safe for concurrent use: its caller writes the metrics in order.
type MembersLog struct {
	Source MemberSource
	Every  time.Duration

	last    time.Time
	lastKey string
}

// DefaultMembersEvery is how often an unchanged membership is written again: often enough
// that a finished run's file shows each rank's late figures, rarely enough that a long run's
// file hardly grows (one record of ~150 bytes a member every 10 s).
const DefaultMembersEvery = 10 * time.Second

// Record returns the members record to write with a train record of step at now, and
// whether one is due.
func (l *MembersLog) Record(step int64, now time.Time) (metrics.Record, bool) {
	ms := l.Source.Members()
	var b strings.Builder
	for _, m := range ms {
		b.WriteString(m.Name + "/" + strconv.Itoa(m.Rank) + "/" + m.State + ";")
	}
	every := cmp.Or(l.Every, DefaultMembersEvery)
	key := b.String()
	if key == l.lastKey && now.Sub(l.last) < every {
		return metrics.Record{}, false
	}
	l.lastKey, l.last = key, now
	return membersRecord(step, now, ms), true
}

// Final returns the members record to write when the run ends, due or not: the members'
// last figures, for the finished run's page.
func (l *MembersLog) Final(step int64, now time.Time) metrics.Record {
	return membersRecord(step, now, l.Source.Members())
}

func membersRecord(step int64, now time.Time, ms []metrics.Member) metrics.Record {
	return metrics.Record{Kind: metrics.KindMembers, Time: float64(now.UnixNano()) / 1e9, Step: step, Members: ms}
}
