package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/trainer"
)

// defaultDashboardAddr is loopback: the page shows a run's figures, which are not for the
// whole network unless the user asks with --addr.
const defaultDashboardAddr = "127.0.0.1:8080"

// cmdDashboard serves the page of a run directory (its metrics.jsonl), of a live cluster
// (PEER: it joins as an observer and shows the members from gossip), or of both (RUN_DIR
// --peer PEER).
func cmdDashboard(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("dashboard")
	addr := fs.String("addr", defaultDashboardAddr, "serve the page on this address (port 0 picks a free one)")
	peerFlag := fs.String("peer", "", "also show the members of the cluster at this gossip address, live (with RUN_DIR)")
	keyFile := fs.String("cluster-key-file", "", "file holding the cluster key, with PEER (default: $"+clusterKeyEnv+")")
	var tf tlsFlags
	tf.register(fs)
	bind := fs.String("bind", "0.0.0.0:0", "gossip address of the dashboard's observer, with PEER")
	timeout := fs.Duration("join-timeout", 10*time.Second, "give up joining PEER after this long")
	arg, code, ok := parseOneArg(fs, args, stdout, stderr)
	if !ok {
		return code
	}
	path, peer := dashboardTarget(arg)
	if *peerFlag != "" {
		if peer != "" {
			return usageError(fs, stderr, "--peer %s with PEER %s: give a run directory and --peer, or PEER alone", *peerFlag, peer)
		}
		peer = *peerFlag
	}
	var opts []dashboard.Option
	title := "cluster at " + peer
	if path != "" {
		dir := filepath.Dir(path)
		title = filepath.Base(dir)
		if abs, err := filepath.Abs(dir); err == nil {
			title = filepath.Base(abs)
		}
	}
	if peer != "" {
		view, stop, code := joinAsObserver(ctx, peer, *keyFile, tf, *bind, *timeout, stderr)
		if code != exitOK {
			return code
		}
		defer stop()
		opts = append(opts, dashboard.WithMembers(view, "gossip through "+peer))
	}
	s, err := dashboard.Listen(*addr, dashboard.New(path, title, opts...))
	if err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		return exitFailure
	}
	what := path
	switch {
	case path == "":
		what = "the cluster at " + peer
	case peer != "":
		what = path + " and the cluster at " + peer
	}
	fmt.Fprintf(stdout, "serving the dashboard of %s on %s (Ctrl-C stops)\n", what, s.URL())
	<-ctx.Done()
	if err := s.Close(); err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		return exitFailure
	}
	return exitOK
}

// dashboardTarget reads qvd dashboard's argument: an existing path, or one ending .jsonl, is
// a metrics file or run directory (path is the metrics file); HOST:PORT with a numeric port is
// a cluster member's gossip address (peer); anything else is a run directory that does not
// exist yet (the run may not have started).
func dashboardTarget(arg string) (path, peer string) {
	st, err := os.Stat(arg)
	switch {
	case err == nil && !st.IsDir(), err != nil && filepath.Ext(arg) == ".jsonl":
		return filepath.Clean(arg), ""
	case err == nil:
		return filepath.Join(arg, "metrics.jsonl"), ""
	}
	if host, port, err := net.SplitHostPort(arg); err == nil && host != "" {
		if p, err := strconv.Atoi(port); err == nil && p > 0 && p < 1<<16 {
			return "", arg
		}
	}
	return filepath.Join(arg, "metrics.jsonl"), ""
}

// joinAsObserver joins the cluster at peer as an observer (as qvd status does, but it stays)
// and returns a view of its members and the function that leaves.
func joinAsObserver(ctx context.Context, peer, keyFile string, tf tlsFlags, bind string, timeout time.Duration, stderr io.Writer) (*dashboard.ClusterView, func(), int) {
	key, err := loadClusterKey(keyFile)
	if err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		return nil, nil, exitUsage
	}
	// Gossip only, but a cluster with TLS refuses members without its CA (cluster.ErrTLSMismatch).
	_, id, err := tf.load(cluster.TLSConfig{})
	if err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		return nil, nil, exitUsage
	}
	cfg := configs.Default().Cluster
	cfg.Key, cfg.Bind, cfg.TLS = key, bind, id
	var b [3]byte
	_, _ = rand.Read(b[:])
	cfg.NodeName = "dashboard-" + hex.EncodeToString(b[:])
	node, err := cluster.New(cfg, cluster.Meta{Role: cluster.RoleObserver}, zap.NewNop())
	if err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		return nil, nil, exitUsage
	}
	jctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if err := node.Join(jctx, peer); err != nil {
		_ = node.Close()
		fmt.Fprintf(stderr, "qvd dashboard: joining %s: %v\n", peer, err)
		return nil, nil, exitFailure
	}
	// Rejoin: a job resumed at the same address is a new cluster the observer is not in.
	view := dashboard.NewClusterView(node, dashboard.ViewOptions{WatchEvents: true, Rejoin: peer})
	return view, func() {
		view.Close()
		_ = node.Close()
	}, exitOK
}

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
