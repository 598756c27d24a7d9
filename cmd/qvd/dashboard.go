package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/job"
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
		view, stop, err := job.Observe(ctx, peer, job.ObserverOptions{Bind: *bind, KeyFile: *keyFile, TLS: tf.files(), Getenv: os.Getenv, Timeout: *timeout})
		if err != nil {
			fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
			if errors.Is(err, configs.ErrInvalid) {
				return exitUsage
			}
			return exitFailure
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
