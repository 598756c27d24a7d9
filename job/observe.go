package job

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/dashboard"
)

// ObserverOptions are an observer's own settings: its gossip address, the cluster key and
// TLS files (as in MemberOptions), and how long joining may take.
type ObserverOptions struct {
	Bind    string
	KeyFile string
	TLS     cluster.TLSConfig
	Getenv  func(string) string
	Timeout time.Duration
}

// Observe joins the cluster at peer as an observer (as qvd status does, but it stays) and
// returns a view of its members and the function that leaves. A key, TLS files or gossip
// settings it cannot use are configs.ErrInvalid; a failed join is not.
func Observe(ctx context.Context, peer string, o ObserverOptions) (*dashboard.ClusterView, func(), error) {
	cfg, err := o.clusterConfig("dashboard-")
	if err != nil {
		return nil, nil, err
	}
	node, err := cluster.New(cfg, cluster.Meta{Role: cluster.RoleObserver}, zap.NewNop())
	if err != nil {
		return nil, nil, invalid(err)
	}
	jctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	if err := node.Join(jctx, peer); err != nil {
		_ = node.Close()
		return nil, nil, fmt.Errorf("joining %s: %w", peer, err)
	}
	// Rejoin: a job resumed at the same address is a new cluster the observer is not in.
	view := dashboard.NewClusterView(node, dashboard.ViewOptions{WatchEvents: true, Rejoin: peer})
	return view, func() {
		view.Close()
		_ = node.Close()
	}, nil
}

// clusterConfig is the gossip configuration of an observer named prefix plus a random
// suffix. A key or TLS files it cannot use are configs.ErrInvalid.
func (o ObserverOptions) clusterConfig(prefix string) (cluster.Config, error) {
	cfg := configs.Default().Cluster
	key, err := LoadClusterKey(o.KeyFile, o.Getenv, nil)
	if err != nil {
		return cfg, invalid(err)
	}
	// Gossip only, but a cluster with TLS refuses members without its CA (cluster.ErrTLSMismatch).
	_, id, err := LoadTLS(o.TLS, o.Getenv, cluster.TLSConfig{}, nil)
	if err != nil {
		return cfg, invalid(err)
	}
	cfg.Key, cfg.Bind, cfg.TLS = key, o.Bind, id
	var b [3]byte
	_, _ = rand.Read(b[:])
	cfg.NodeName = prefix + hex.EncodeToString(b[:])
	return cfg, nil
}
