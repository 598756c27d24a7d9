package cluster

import (
	"context"
	"errors"
	"fmt"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The control service, described by hand (no protoc in the build; messages are JSON, see
// codec.go). Rendezvous is two-phase so that no rank starts before every rank holds the
// roster: the coordinator sends Prepare (the signed roster) to every member and, once all
// have accepted it, Commit; a member's AwaitRoster returns only on Commit.
const (
	controlServiceName = "qvd.cluster.v1.Control"
	methodPrepare      = "/" + controlServiceName + "/Prepare"
	methodCommit       = "/" + controlServiceName + "/Commit"
)

// controlServer is the service's handler interface, as protoc would generate it.
type controlServer interface {
	prepare(context.Context, *rosterMsg) (*ackMsg, error)
	commit(context.Context, *commitMsg) (*ackMsg, error)
}

var controlServiceDesc = grpc.ServiceDesc{
	ServiceName: controlServiceName,
	HandlerType: (*controlServer)(nil),
	Methods: []grpc.MethodDesc{
		{MethodName: "Prepare", Handler: prepareHandler},
		{MethodName: "Commit", Handler: commitHandler},
	},
	Metadata: "cluster/control.go",
}

func prepareHandler(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
	in := new(rosterMsg)
	if err := dec(in); err != nil {
		return nil, err
	}
	if ic == nil {
		return srv.(controlServer).prepare(ctx, in)
	}
	info := &grpc.UnaryServerInfo{Server: srv, FullMethod: methodPrepare}
	return ic(ctx, in, info, func(ctx context.Context, req any) (any, error) {
		return srv.(controlServer).prepare(ctx, req.(*rosterMsg))
	})
}

func commitHandler(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
	in := new(commitMsg)
	if err := dec(in); err != nil {
		return nil, err
	}
	if ic == nil {
		return srv.(controlServer).commit(ctx, in)
	}
	info := &grpc.UnaryServerInfo{Server: srv, FullMethod: methodCommit}
	return ic(ctx, in, info, func(ctx context.Context, req any) (any, error) {
		return srv.(controlServer).commit(ctx, req.(*commitMsg))
	})
}

func callPrepare(ctx context.Context, cc grpc.ClientConnInterface, in *rosterMsg) (*ackMsg, error) {
	return callPrepareWith(ctx, cc, in, true)
}

func callPrepareWith(ctx context.Context, cc grpc.ClientConnInterface, in *rosterMsg, waitForReady bool) (*ackMsg, error) {
	out := new(ackMsg)
	// WaitForReady: a worker's server may still be starting; ctx bounds the wait.
	if err := cc.Invoke(ctx, methodPrepare, in, out, grpc.CallContentSubtype(codecName), grpc.WaitForReady(waitForReady)); err != nil {
		return nil, err
	}
	return out, nil
}

func callCommit(ctx context.Context, cc grpc.ClientConnInterface, in *commitMsg) (*ackMsg, error) {
	out := new(ackMsg)
	if err := cc.Invoke(ctx, methodCommit, in, out, grpc.CallContentSubtype(codecName), grpc.WaitForReady(true)); err != nil {
		return nil, err
	}
	return out, nil
}

// Register installs the control service on the process's gRPC server (before it serves).
// The server must be built with ServerOptions(cfg.Key) so that only key holders reach it.
func (n *Node) Register(s grpc.ServiceRegistrar) {
	s.RegisterService(&controlServiceDesc, &controlHandler{n: n})
}

type controlHandler struct{ n *Node }

var _ controlServer = (*controlHandler)(nil)

// rosterState is a member's side of the rendezvous.
type rosterState struct {
	pending   *Roster       // accepted by Prepare, awaiting Commit
	committed *Roster       // the latest committed roster
	delivered uint64        // Gen of the last roster AwaitRoster returned
	ready     chan struct{} // closed and replaced when a roster is committed
}

func (s *rosterState) init() { s.ready = make(chan struct{}) }

func refuse(code codes.Code, err error) error { return status.Error(code, err.Error()) }

func (h *controlHandler) prepare(_ context.Context, in *rosterMsg) (*ackMsg, error) {
	n := h.n
	r, err := openRoster(n.keys, in)
	if err != nil {
		n.log.Warn("refused a roster", zap.Error(err))
		if errors.Is(err, errSignature) {
			return nil, refuse(codes.Unauthenticated, err)
		}
		return nil, refuse(codes.InvalidArgument, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.closed {
		return nil, status.Error(codes.Unavailable, ErrClosed.Error())
	}
	me := n.mu.meta
	st := &n.mu.roster
	rank := r.RankOf(n.cfg.NodeName)
	switch {
	case me.Role != RoleWorker:
		return nil, refuse(codes.FailedPrecondition, fmt.Errorf("%w: %s has role %s; only workers take a rank from a roster", ErrBadRoster, n.cfg.NodeName, me.Role))
	case rank < 0:
		return nil, refuse(codes.FailedPrecondition, fmt.Errorf("%w: roster of job %s does not name %s", ErrBadRoster, r.Job, n.cfg.NodeName))
	case r.Members[rank].Gen != me.Gen:
		return nil, refuse(codes.FailedPrecondition, fmt.Errorf("%w: roster names an earlier process under the name %s (gen %d, this process is gen %d)",
			ErrBadRoster, n.cfg.NodeName, r.Members[rank].Gen, me.Gen))
	case me.Job != "" && me.Job != r.Job:
		return nil, refuse(codes.FailedPrecondition, fmt.Errorf("%w: %s belongs to job %s, not %s", ErrBadRoster, n.cfg.NodeName, me.Job, r.Job))
	case st.committed != nil && st.committed.Job == r.Job && st.committed.Members[0].Name == r.Members[0].Name && st.committed.Gen > r.Gen:
		// Generations are the coordinator's clock, so only compare a coordinator's rosters
		// with its own: a restarted coordinator on another machine may run behind.
		return nil, refuse(codes.FailedPrecondition, fmt.Errorf("%w: stale roster of job %s (gen %d, already committed gen %d)", ErrBadRoster, r.Job, r.Gen, st.committed.Gen))
	}
	r.Rank = rank
	if st.committed == nil || st.committed.Gen != r.Gen || st.committed.Job != r.Job {
		st.pending = r
	}
	n.log.Debug("roster prepared", zap.String("job", r.Job), zap.Uint64("gen", r.Gen), zap.Int("rank", r.Rank))
	ack := &ackMsg{Name: n.cfg.NodeName, Rank: r.Rank}
	if s := n.mu.suspects; s.job == r.Job && s.gen < r.Gen {
		ack.Suspects = append([]string(nil), s.names...)
	}
	return ack, nil
}

func (h *controlHandler) commit(_ context.Context, in *commitMsg) (*ackMsg, error) {
	n := h.n
	if err := verifyCommit(n.keys, in); err != nil {
		n.log.Warn("refused a roster commit", zap.Error(err))
		return nil, refuse(codes.Unauthenticated, err)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.closed {
		return nil, status.Error(codes.Unavailable, ErrClosed.Error())
	}
	st := &n.mu.roster
	switch {
	case st.pending != nil && st.pending.Job == in.Job && st.pending.Gen == in.Gen:
		st.committed, st.pending = st.pending, nil
		close(st.ready)
		st.ready = make(chan struct{})
		n.log.Info("roster committed", zap.String("job", in.Job), zap.Uint64("gen", in.Gen), zap.Int("rank", st.committed.Rank), zap.Int("world", st.committed.World))
		return &ackMsg{Name: n.cfg.NodeName, Rank: st.committed.Rank}, nil
	case st.committed != nil && st.committed.Job == in.Job && st.committed.Gen == in.Gen:
		return &ackMsg{Name: n.cfg.NodeName, Rank: st.committed.Rank}, nil // a retried commit
	}
	return nil, refuse(codes.FailedPrecondition, fmt.Errorf("%w: commit of job %s gen %d, but no such roster was prepared on %s", ErrBadRoster, in.Job, in.Gen, n.cfg.NodeName))
}
