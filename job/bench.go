package job

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/bench"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
)

// ErrWrongElements is Bench's error when a collective's result was wrong somewhere.
var ErrWrongElements = errors.New("wrong elements")

// BenchOptions are one rank of `qvd bench`: the benchmark, the job it belongs to and the
// data plane it measures.
type BenchOptions struct {
	Spec  bench.Spec
	Sizes []int64
	// World is the number of ranks the coordinator waits for.
	World int
	// Join is the coordinator's gossip address; "" makes this rank the coordinator.
	Join string
	// Transport is collective.transport (nccl: a binary built with -tags cuda, bootstrapped
	// over the gRPC ring); ChunkBytes > 0 sets every ring's piece size, shared memory's too.
	Transport  string
	ChunkBytes int
	// Member is this rank's member; its Getenv also gives the local rank, which picks the
	// GPU for NCCL.
	Member MemberOptions
	// Stdout gets rank 0's report; Stderr the log (warnings and above).
	Stdout, Stderr io.Writer
}

// Bench runs one rank of a collective benchmark: it joins the others (or coordinates them),
// builds the communicator o.Transport names and runs bench.Run on it, rank 0 printing the
// report. Wrong elements are ErrWrongElements, after every rank has finished.
func Bench(ctx context.Context, o BenchOptions) error {
	lg, err := NewLogger(o.Stderr, "", zapcore.WarnLevel)
	if err != nil {
		return err
	}
	defer lg.Close()
	role, jobID := cluster.RoleWorker, ""
	if o.Join == "" {
		role, jobID = cluster.RoleCoordinator, NewJobID("bench")
	}
	m, err := StartMember(configs.Default().Cluster, cluster.TLSConfig{}, role, jobID, o.Member, lg.Log)
	if err != nil {
		return err
	}
	defer m.Close()
	var roster *cluster.Roster
	if o.Join != "" {
		if err = JoinWithRetry(ctx, m, o.Join, time.Minute, lg.Log); err == nil {
			roster, err = m.Node().AwaitRoster(ctx)
		}
	} else {
		roster, err = m.Node().Coordinate(ctx, jobID, o.World, []byte("bench"))
	}
	if err != nil {
		return err
	}
	ccfg := collective.DefaultConfig()
	ccfg.Transport = o.Transport
	if o.ChunkBytes > 0 {
		ccfg.ChunkBytes, ccfg.ShmChunkBytes = o.ChunkBytes, o.ChunkBytes
	}
	if o.Transport == collective.TransportNCCL {
		ccfg.Transport = collective.TransportGRPC // NCCL's unique id is exchanged over the gRPC ring
	}
	d, err := m.Communicator(ctx, roster, ccfg)
	if err == nil && o.Transport == collective.TransportNCCL {
		var nc collective.Communicator
		if nc, err = NCCLOver(ctx, d.Comm, LocalRank(o.Member.Getenv, roster.Rank), engine.DefaultConfig()); err != nil {
			d.Close()
		}
		d.Comm = nc
	}
	if err != nil {
		return err
	}
	defer d.Close()
	comm := d.Comm
	if comm.Rank() == 0 {
		fmt.Fprint(o.Stdout, bench.Header(o.Spec, comm.Size(), d.Plan, o.Transport, ccfg))
	}
	wrong, err := bench.Run(ctx, comm, o.Spec, o.Sizes, o.Stdout)
	if err != nil {
		return err
	}
	// Everyone finishes before anyone leaves, so no rank sees a peer vanish mid-call.
	if err := comm.Barrier(ctx); err != nil {
		lg.Log.Warn("final barrier", zap.Error(err))
	}
	if wrong > 0 {
		return fmt.Errorf("%s: %d %w", o.Spec.Coll.Name, wrong, ErrWrongElements)
	}
	return nil
}
