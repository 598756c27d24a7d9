package job

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strconv"

	"github.com/qvd/qvd/internal/dashboard"
)

// DashboardTarget reads qvd dashboard's argument: an existing path, or one ending .jsonl, is
// a metrics file or run directory (path is the metrics file); HOST:PORT with a numeric port is
// a cluster member's gossip address (peer); anything else is a run directory that does not
// exist yet (the run may not have started).
func DashboardTarget(arg string) (path, peer string) {
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

// DashboardOptions are what `qvd dashboard` serves: a run's metrics file, a live cluster
// (joined through Peer as an observer), or both.
type DashboardOptions struct {
	Addr     string // where the page is served (port 0 picks a free one)
	Path     string // the metrics file; "" for a cluster alone
	Peer     string // a member's gossip address; "" for a run alone
	Observer ObserverOptions
	// Serving is told what is served and the page's URL once it listens.
	Serving func(what, url string)
}

// ServeDashboard serves the page until ctx is done. An observer that cannot join for its
// key, TLS files or settings is configs.ErrInvalid, as in Observe.
func ServeDashboard(ctx context.Context, o DashboardOptions) error {
	var opts []dashboard.Option
	title := "cluster at " + o.Peer
	if o.Path != "" {
		dir := filepath.Dir(o.Path)
		title = filepath.Base(dir)
		if abs, err := filepath.Abs(dir); err == nil {
			title = filepath.Base(abs)
		}
	}
	if o.Peer != "" {
		view, stop, err := Observe(ctx, o.Peer, o.Observer)
		if err != nil {
			return err
		}
		defer stop()
		opts = append(opts, dashboard.WithMembers(view, "gossip through "+o.Peer))
	}
	s, err := dashboard.Listen(o.Addr, dashboard.New(o.Path, title, opts...))
	if err != nil {
		return err
	}
	what := o.Path
	switch {
	case o.Path == "":
		what = "the cluster at " + o.Peer
	case o.Peer != "":
		what = o.Path + " and the cluster at " + o.Peer
	}
	if o.Serving != nil {
		o.Serving(what, s.URL())
	}
	<-ctx.Done()
	return s.Close()
}
