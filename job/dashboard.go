package job

import (
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/trainer"
)

// serveDashboard starts the job's own dashboard when dashboard.addr is set (rank 0 only: it
// writes the metrics file the page reads; in a multi-node job the members come from its
// node's gossip). It returns the function that stops it.
func (j *job) serveDashboard() (func(), error) {
	if j.cfg.Dashboard.Addr == "" {
		return func() {}, nil
	}
	var opts []dashboard.Option
	if j.member != nil {
		// The trainer's peer watch reads the node's events: this view does not.
		view := dashboard.NewClusterView(j.member.node, dashboard.ViewOptions{Job: j.roster.Job})
		opts = append(opts, dashboard.WithMembers(view, "gossip (rank 0's node)"))
	}
	s, err := dashboard.Listen(j.cfg.Dashboard.Addr, dashboard.New(j.cfg.MetricsPath(), j.cfg.Run.Name, opts...))
	if err != nil {
		return nil, err
	}
	j.log.Info("serving the dashboard", zap.String("dashboard_url", s.URL()))
	return func() {
		if err := s.Close(); err != nil {
			j.log.Warn("the dashboard failed", zap.String("addr", s.Addr()), zap.Error(err))
		}
	}, nil
}

// gossipMemory puts a train record's resident set and largest phase-end heap into the
// member's gossip metadata, for the dashboards' per-rank memory.
func gossipMemory(n *cluster.Node, r metrics.Record) {
	var peak int64
	for _, b := range r.PhaseHeap {
		peak = max(peak, b)
	}
	n.SetMemory(r.RSSBytes, uint64(peak))
}

// rendezvousRecord is the event rank 0 writes when its job's group has formed.
func rendezvousRecord(r *cluster.Roster, step int64) metrics.Record {
	return metrics.Record{Kind: metrics.KindEvent, Time: float64(time.Now().UnixNano()) / 1e9, Step: step,
		Event: metrics.EventRendezvous, Gen: r.Gen, World: r.World, Detail: "job " + r.Job}
}

// membersDue returns the members record to write after r, when one is due (see
// dashboard.MembersLog): rank 0 of a multi-node job, after a train record.
func (s stepSink) membersDue(r metrics.Record) (metrics.Record, bool) {
	if s.members == nil || r.Kind != metrics.KindTrain {
		return metrics.Record{}, false
	}
	return s.members.Record(r.Step, time.Now())
}

// memberLostRecord is the event rank 0 writes when gossip reports a member of its job gone.
func memberLostRecord(err error) metrics.Record {
	return metrics.Record{Kind: metrics.KindEvent, Time: float64(time.Now().UnixNano()) / 1e9,
		Event: metrics.EventMemberLost, Detail: err.Error()}
}

// stoppedRecord is the event rank 0 writes when its run ends early with err.
func stoppedRecord(res trainer.Result, err error) metrics.Record {
	why := "failed: " + err.Error()
	if res.Interrupted {
		why = "interrupted: " + err.Error()
		if res.Checkpoint != "" {
			why += "; checkpoint " + res.Checkpoint
		}
	}
	return metrics.Record{Kind: metrics.KindEvent, Time: float64(time.Now().UnixNano()) / 1e9, Step: res.Steps,
		Event: metrics.EventStopped, Detail: why}
}
