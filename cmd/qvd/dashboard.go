package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"go.uber.org/zap"

	"github.com/qvd/qvd/internal/dashboard"
)

// defaultDashboardAddr is loopback: the page shows a run's figures, which are not for the
// whole network unless the user asks with --addr.
const defaultDashboardAddr = "127.0.0.1:8080"

func cmdDashboard(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("dashboard")
	addr := fs.String("addr", defaultDashboardAddr, "serve the page on this address (port 0 picks a free one)")
	path, code, ok := parseOneArg(fs, args, stdout, stderr)
	if !ok {
		return code
	}
	// RUN_DIR or its metrics.jsonl, as qvd plot takes; a run directory that does not exist
	// yet is fine (the run may not have started).
	st, err := os.Stat(path)
	if (err == nil && !st.IsDir()) || (err != nil && filepath.Ext(path) == ".jsonl") {
		path = filepath.Clean(path)
	} else {
		path = filepath.Join(path, "metrics.jsonl")
	}
	dir := filepath.Dir(path)
	title := filepath.Base(dir)
	if abs, err := filepath.Abs(dir); err == nil {
		title = filepath.Base(abs)
	}
	s, err := dashboard.Listen(*addr, dashboard.New(path, title))
	if err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		return exitFailure
	}
	fmt.Fprintf(stdout, "serving the dashboard of %s on %s (Ctrl-C stops)\n", path, s.URL())
	<-ctx.Done()
	if err := s.Close(); err != nil {
		fmt.Fprintf(stderr, "qvd dashboard: %v\n", err)
		return exitFailure
	}
	return exitOK
}

// serveDashboard starts the job's own dashboard when dashboard.addr is set (rank 0 only: it
// writes the metrics file the page reads). It returns the function that stops it.
func (j *job) serveDashboard() (func(), error) {
	if j.cfg.Dashboard.Addr == "" {
		return func() {}, nil
	}
	s, err := dashboard.Listen(j.cfg.Dashboard.Addr, dashboard.New(j.cfg.MetricsPath(), j.cfg.Run.Name))
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
