package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/qvd/qvd/configs"
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
	keyFile := fs.String("cluster-key-file", "", "file holding the cluster key, with PEER (default: $"+job.ClusterKeyEnv+")")
	var tf tlsFlags
	tf.register(fs)
	bind := fs.String("bind", "0.0.0.0:0", "gossip address of the dashboard's observer, with PEER")
	timeout := fs.Duration("join-timeout", 10*time.Second, "give up joining PEER after this long")
	arg, code, ok := parseOneArg(fs, args, stdout, stderr)
	if !ok {
		return code
	}
	path, peer := job.DashboardTarget(arg)
	if *peerFlag != "" {
		if peer != "" {
			return usageError(fs, stderr, "--peer %s with PEER %s: give a run directory and --peer, or PEER alone", *peerFlag, peer)
		}
		peer = *peerFlag
	}
	err := job.ServeDashboard(ctx, job.DashboardOptions{Addr: *addr, Path: path, Peer: peer,
		Observer: job.ObserverOptions{Bind: *bind, KeyFile: *keyFile, TLS: tf.files(), Getenv: os.Getenv, Timeout: *timeout},
		Serving: func(what, url string) {
			fmt.Fprintf(stdout, "serving the dashboard of %s on %s (Ctrl-C stops)\n", what, url)
		}})
	if err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		if errors.Is(err, configs.ErrInvalid) {
			return exitUsage
		}
		return exitFailure
	}
	return exitOK
}
