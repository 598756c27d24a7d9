package job

import (
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/model"
)

// initFrom applies init_from to params after the random initialisation, before the engine,
// the optimizer state and the ZeRO shards are built. Only rank 0 reads the file: the trainer
// starts every multi-rank run by broadcasting rank 0's weights to all ranks (syncFromRank0, as
// DDP does at construction), so the workers need no copy of the file, as with --resume.
// A run resumed from a named checkpoint takes its weights from it and skips the file; with
// --resume auto the file is loaded and a checkpoint found later replaces it.
func (j *job) initFrom(layout *model.Layout, params []float32) error {
	ic := j.cfg.Init()
	if ic.From == "" || j.rank != 0 {
		return nil
	}
	if j.resume != "" && j.resume != checkpoint.ResumeAuto {
		j.log.Info("init_from: not loaded, the run resumes from a checkpoint", zap.String("init_from", ic.From), zap.String("resume", j.resume))
		return nil
	}
	rep, err := model.LoadInit(ic, layout, params)
	logInitReport(j.log, ic, rep)
	if errors.Is(err, model.ErrInitMismatch) {
		return fmt.Errorf("init_from: %w\n(rename the file's tensors with init_map, or set init_strict: false to load a partial model)", err)
	}
	if err != nil {
		return fmt.Errorf("init_from: %w", err)
	}
	j.log.Info("init_from: weights initialised from the file", zap.String("file", ic.From), zap.Int("loaded", len(rep.Loaded)),
		zap.Int("missing", len(rep.Missing)), zap.Int("unexpected", len(rep.Unexpected)), zap.Bool("strict", ic.Strict))
	return nil
}

// logInitReport logs every tensor a load matched, missed or could not place.
func logInitReport(log *zap.Logger, ic model.InitConfig, rep model.InitReport) {
	for _, t := range rep.Loaded {
		log.Info("init_from: loaded", zap.String("tensor", t.Model), zap.String("from", t.File), zap.Ints("shape", t.Shape))
	}
	for _, name := range rep.Missing {
		log.Warn("init_from: missing from the file, keeps its random initialisation", zap.String("tensor", name), zap.String("file", ic.From))
	}
	for _, name := range rep.Unexpected {
		log.Warn("init_from: unexpected tensor in the file, not loaded", zap.String("tensor", name), zap.String("file", ic.From))
	}
}
