package job

import (
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/configs"
)

// JoinWithRetry joins through peer, retrying while the peer is not up yet (workers are often
// started before, or at the same time as, the coordinator), for up to patience. A refusal —
// wrong key, incompatible version, another TLS CA — is final.
func JoinWithRetry(ctx context.Context, m *Member, peer string, patience time.Duration, log *zap.Logger) error {
	ctx, cancel := context.WithTimeout(ctx, patience)
	defer cancel()
	wait := 200 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := m.node.Join(ctx, peer)
		if err == nil || !cluster.Retryable(err) {
			return err
		}
		if attempt == 1 {
			log.Info("peer not reachable yet; retrying", zap.String("peer", peer), zap.Error(err))
		}
		select {
		case <-ctx.Done():
			if cause := context.Cause(ctx); !errors.Is(cause, context.DeadlineExceeded) {
				return fmt.Errorf("%w while joining through %s", cause, peer) // a signal, not the patience
			}
			return fmt.Errorf("no answer from %s within %v: %w", peer, patience, err)
		case <-time.After(wait):
		}
		wait = min(2*wait, 2*time.Second)
	}
}

// AwaitJob is a worker's way into a job: it joins the cluster through peer (JoinWithRetry,
// within the default rendezvous timeout), waits for the coordinator's roster, and returns it
// with the job's config as this worker runs it: dataPath, if not "", replaces data.path (a
// path on this machine), and the TLS files are the member's own (the coordinator's paths mean
// nothing here). An unusable config is configs.ErrInvalid.
func AwaitJob(ctx context.Context, m *Member, peer, dataPath string, log *zap.Logger) (*cluster.Roster, configs.Config, error) {
	if err := JoinWithRetry(ctx, m, peer, configs.Default().Cluster.RendezvousTimeout, log); err != nil {
		return nil, configs.Config{}, err
	}
	log.Info("joined; waiting for the coordinator's roster", zap.String("peer", peer))
	roster, err := m.node.AwaitRoster(ctx)
	if err != nil {
		return nil, configs.Config{}, err
	}
	cfg, err := configs.Parse(roster.Config, "the coordinator's config")
	if err != nil {
		return nil, cfg, err // configs.ErrInvalid
	}
	if dataPath != "" {
		cfg.Data.Path = dataPath
	}
	cfg.TLS = m.tlsCfg
	if err := cfg.Validate(); err != nil {
		return nil, cfg, invalid(err)
	}
	return roster, cfg, nil
}
