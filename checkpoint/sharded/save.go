package sharded

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
)

// Save is one rank's part of a checkpoint of the whole group. Rank 0 writes the full model
// and meta.json; every rank the Plan names writes its optimizer shard, keyed by flat offset,
// into the same pending directory (so at stages 1-2 Dir must be a filesystem shared by the
// ranks); rank 0 commits once all have succeeded.
type Save struct {
	Step int64
	// Dir is checkpoint.dir: ranks other than 0 find the pending directory under it.
	Dir  string
	Plan Plan
	// Manager is rank 0's (nil on the others).
	Manager *checkpoint.Manager
	// WriteShard writes this rank's optimizer shard (called where Plan.Writes(rank)).
	WriteShard func(w io.Writer) error
	// WriteModel writes ModelFile (rank 0).
	WriteModel func(w io.Writer) error
	// Meta returns meta.json's value (rank 0, once every file is written).
	Meta func() Meta
	// Log gets the warnings a save survives (nil: none).
	Log *zap.Logger
}

// Run performs the save in three phases — starting the pending directory, writing the files,
// committing — after each of which the ranks agree on success, so a failed save fails every
// rank together and publishes nothing. Every rank calls it; it returns the checkpoint's path.
func (s Save) Run(ctx context.Context, comm Comm) (string, error) {
	log := s.Log
	if log == nil {
		log = zap.NewNop()
	}
	rank := group{comm}.rank()
	var p *checkpoint.Pending
	fail := func(err error) (string, error) {
		if p != nil {
			if aerr := p.Abort(); aerr != nil {
				log.Warn("removing the failed checkpoint's pending directory", zap.Error(aerr))
			}
		}
		return "", err
	}
	var werr error
	if rank == 0 {
		p, werr = s.Manager.BeginShared(s.Step)
	}
	if err := Agree(ctx, comm, s.Step, werr, "starting"); err != nil {
		return fail(err)
	}
	shardName := ShardFile(rank)
	werr = nil
	switch {
	case rank == 0:
		_, werr = p.WriteFile(shardName, s.WriteShard)
		if werr == nil {
			_, werr = p.WriteFile(ModelFile, s.WriteModel)
		}
	case s.Plan.Writes(rank):
		// Rank 0's Manager read the run id from the same file when the run started; the
		// run directory's lock keeps it unchanged while the run lasts.
		runID, err := checkpoint.ReadRunID(s.Dir)
		dir := checkpoint.SharedPendingDir(s.Dir, runID, s.Step)
		if err == nil {
			_, err = os.Stat(dir)
		}
		if err != nil {
			werr = fmt.Errorf("rank %d cannot see the checkpoint rank 0 started (%w): at ZeRO stage %d every rank writes its optimizer shard into checkpoint.dir, which must be a filesystem shared by all ranks",
				rank, err, s.Plan.Stage)
		} else {
			_, werr = checkpoint.WriteFileIn(dir, shardName, s.WriteShard)
		}
	}
	if werr != nil {
		werr = fmt.Errorf("checkpoint at step %d: %w", s.Step, werr)
	}
	if err := Agree(ctx, comm, s.Step, werr, "writing"); err != nil {
		return fail(err)
	}
	var path string
	if rank == 0 {
		path, werr = s.commit(p, log)
	}
	if err := Agree(ctx, comm, s.Step, werr, "committing"); err != nil {
		return fail(err)
	}
	if path == "" {
		path = filepath.Join(s.Dir, checkpoint.StepDirName(s.Step))
	}
	return path, nil
}

// commit records the other ranks' shards and publishes the checkpoint (rank 0).
func (s Save) commit(p *checkpoint.Pending, log *zap.Logger) (string, error) {
	var others []checkpoint.FileInfo
	for _, r := range s.Plan.Writers() {
		if r == 0 {
			continue
		}
		fi, err := checkpoint.Describe(p.Dir(), ShardFile(r))
		if err != nil {
			return "", fmt.Errorf("checkpoint at step %d: the optimizer shard of rank %d: %w", s.Step, r, err)
		}
		others = append(others, fi)
	}
	path, err := p.Commit(s.Meta(), others...)
	if errors.Is(err, checkpoint.ErrPrune) {
		log.Warn("checkpoint saved, but removing old checkpoints failed", zap.Error(err))
		return path, nil
	}
	if err != nil {
		return "", fmt.Errorf("saving checkpoint at step %d: %w", s.Step, err)
	}
	return path, nil
}
