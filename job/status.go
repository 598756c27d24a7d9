package job

import (
	"context"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
)

// Status joins the cluster at peer as a short-lived observer and returns its members (as
// qvd status prints them), giving up after o.Timeout. A key or TLS files it cannot use are
// configs.ErrInvalid; a failed join is not.
func Status(ctx context.Context, peer string, o ObserverOptions) ([]cluster.Member, error) {
	cfg, err := o.clusterConfig("status-")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	return cluster.Status(ctx, cfg, peer, zap.NewNop())
}
