package job

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"runtime/debug"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/blas"
	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/monitor"
	"github.com/qvd/qvd/internal/promexport"
	"github.com/qvd/qvd/internal/version"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/trainer"
)

// train builds this process's trainer from the job and runs it.
func (j *job) train(ctx context.Context) (trainer.Result, error) {
	cfg, log := j.cfg, j.log
	// Parameters, gradients, optimizer state and activations live outside the Go heap
	// (internal/arena), so the heap holds small objects only and a tight collection target
	// costs little CPU: GOGC 25 keeps the heap's resident memory within a quarter of what is
	// live, where the default lets it reach twice that. GOGC in the environment wins.
	if _, set := j.lookupEnv("GOGC"); !set {
		defer debug.SetGCPercent(debug.SetGCPercent(25))
	}
	start := time.Now()
	mon, err := memory.New(cfg.Memory, memory.Options{})
	if err != nil {
		return trainer.Result{}, fmt.Errorf("memory.%w", err)
	}
	defer mon.Close()
	splits, err := data.OpenSplits(cfg.Data, data.Options{Warn: func(err error) { log.Warn("skipping a sample", zap.Error(err)) }, Seed: cfg.Run.Seed})
	if err != nil {
		return trainer.Result{}, err
	}
	trainSet, testSet := splits.Train, splits.Test
	norm, err := cfg.Data.Norm(trainSet.C)
	if err != nil {
		return trainer.Result{}, err
	}
	defer func() {
		if n := trainSet.Skipped(); n > 0 {
			log.Warn("samples skipped: their files could not be decoded (data.on_error: skip)", zap.Int("data_skipped", n))
		}
	}()
	spec, err := model.NewSpec(cfg.Model, []int{trainSet.C, trainSet.H, trainSet.W}, trainSet.Classes)
	if err != nil {
		return trainer.Result{}, err
	}
	build := mon.Measure("model build")
	frozen, err := cfg.Freeze.Frozen(spec)
	if err != nil {
		return trainer.Result{}, err
	}
	layout := model.NewLayoutFrozen(spec, frozen)
	// The parameters outside the Go heap (internal/arena): the collector neither scans nor
	// counts them, and its headroom does not double them.
	pblock, params, err := arena.Float32s(layout.Size, arena.Params)
	if err != nil {
		return trainer.Result{}, fmt.Errorf("placing the parameters: %w", err)
	}
	defer pblock.Free()
	model.Init(spec, layout, params, cfg.Run.Seed)
	if err := j.initFrom(layout, params); err != nil {
		return trainer.Result{}, err
	}
	eng, err := newEngine(cfg, spec, layout, params, LocalRank(j.getenv, j.rank), log)
	if err != nil {
		return trainer.Result{}, err
	}
	defer eng.Close()
	logMeasure(log, build.Done())
	log.Info("qvd", zap.String("version", version.Version), zap.String("run", cfg.Run.Name), zap.String("out", cfg.Run.Out),
		zap.String("model", spec.String()), zap.Int("params", layout.NumParams()), zap.String("blas", blas.Use()), zap.String("device", eng.device),
		zap.Int("train_samples", trainSet.N), zap.Int("test_samples", testSet.N))

	var from *checkpoint.Checkpoint
	if j.resume != "" && j.rank == 0 {
		c, skipped, err := checkpoint.Resolve(j.resume, cfg.Checkpoint.Dir)
		for _, s := range skipped {
			log.Warn("skipping a checkpoint that failed verification", zap.Error(s))
		}
		switch {
		case err == nil:
			from = c
		case j.resume == "auto" && errors.Is(err, checkpoint.ErrNoCheckpoint):
			dir, _ := filepath.Abs(cfg.Checkpoint.Dir)
			log.Warn("--resume auto found no checkpoint in "+dir+": starting fresh", zap.String("dir", dir), zap.Error(err))
		default:
			return trainer.Result{}, fmt.Errorf("--resume %s: %w", j.resume, err)
		}
	}
	prom, stopMetrics, err := j.serveMetrics()
	if err != nil {
		return trainer.Result{}, err
	}
	defer stopMetrics()
	sink := stepSink{logErr: j.logErr, prom: prom}
	if j.member != nil {
		sink.node = j.member.node
	}
	if j.rank == 0 {
		mw, err := metrics.Create(cfg.MetricsPath(), from != nil)
		if err != nil {
			return trainer.Result{}, err
		}
		defer mw.Close()
		sink.file = mw
		if j.roster != nil { // the group formed: a re-form after a resume shows as a new generation
			var step int64
			if from != nil {
				step = from.Step()
			}
			if err := mw.Write(rendezvousRecord(j.roster, step)); err != nil {
				return trainer.Result{}, err
			}
			sink.members = &dashboard.MembersLog{Source: dashboard.NewClusterView(j.member.node, dashboard.ViewOptions{Job: j.roster.Job})}
		}
		// The page is the running job's: it stops when the job returns (qvd dashboard RUN_DIR
		// shows a finished run).
		stopDashboard, err := j.serveDashboard()
		if err != nil {
			return trainer.Result{}, err
		}
		defer stopDashboard()
		mon, err := monitor.Open(cfg.Monitors(), monitor.Options{Resume: from != nil})
		if err != nil {
			return trainer.Result{}, err
		}
		defer mon.Close()
		sink.monitors = mon
	}
	setup := trainer.Setup{
		Config: cfg.Train, Schedule: cfg.Scheduler, Scaler: cfg.FP16, Optimizer: cfg.Optimizer, Zero: cfg.Zero, Checkpoint: cfg.Checkpoint,
		Seed: cfg.Run.Seed, Model: eng.model, Pool: eng.pool, Train: trainSet, Test: testSet, Val: splits.Val, Normalize: norm,
		Resume: from, ConfigSnapshot: cfg, Metrics: sink, Logger: log, Comm: j.comm,
	}
	if j.line != nil {
		setup.Progress = j.line
	}
	setup.MemoryMonitor = mon
	setup.Rebuild, setup.AdaptOnPressure = eng.rebuild, cfg.Memory.Adapt
	setup.Prefetch = cfg.Data.Prefetch
	mem := j.membership()
	if mem != nil {
		setup.Admit = j.admit(mem)
		if every, auto := cfg.Elastic.SnapshotSteps(); auto {
			setup.SnapshotEvery = trainer.SnapshotAuto
		} else {
			setup.SnapshotEvery = every
		}
		if _, err := j.joinRunning(ctx, &setup); err != nil {
			return trainer.Result{}, err
		}
	}
	samples, closeSamples, err := j.sampleLog()
	if err != nil {
		return trainer.Result{}, err
	}
	defer closeSamples()
	setup.SampleLog = samples
	build = mon.Measure("trainer build")
	t, err := trainer.New(setup)
	if err != nil {
		return trainer.Result{}, err
	}
	defer func() { t.Close() }() // the last generation's (elastic training replaces it)
	if j.rank == 0 {             // trainer.New has checked checkpoint.dir
		if err := trainer.CheckDir(cfg.Run.Out, (t.TotalSteps()-t.Step())*metricsBytesPerStep); err != nil {
			return trainer.Result{}, fmt.Errorf("run.out: %w", err)
		}
		if err := j.logErr(); err != nil { // the lines logged so far did not reach the file
			return trainer.Result{}, err
		}
	}
	logMeasure(log, build.Done())
	restore, err := applyMemoryLimit(cfg.Memory.Limit, t.Memory(), log)
	if err != nil {
		return trainer.Result{}, err
	}
	defer restore()
	if j.member != nil && mem == nil {
		lost := t.Abort
		if sink.file != nil {
			lost = func(err error) {
				_ = sink.file.Write(memberLostRecord(err)) // after the run the file is closed: no event
				t.Abort(err)
			}
		}
		j.member.watchPeers(j.roster, lost, nil)
	}
	var res trainer.Result
	var pending *reformSink // the last re-form's record, until its first step completes
	for {
		var stopWatch func()
		if mem != nil {
			cur := t
			stopWatch = mem.Watch(func(err error) {
				if sink.file != nil {
					_ = sink.file.Write(memberLostRecord(err))
				}
				cur.Abort(fmt.Errorf("%w: %w", ErrMemberLost, err))
			})
		}
		res, err = t.Run(ctx)
		if stopWatch != nil {
			stopWatch()
		}
		if err == nil || mem == nil || res.Interrupted || ctx.Err() != nil || !(lostMember(err) || errors.Is(err, trainer.ErrRegroup)) {
			break
		}
		if ferr := flushReform(pending); ferr != nil {
			err = ferr
			break
		}
		pending = &reformSink{next: sink, lost: time.Now()}
		gsetup := setup
		gsetup.Metrics = pending
		next, rerr := j.reform(ctx, mem, t, gsetup, err)
		if rerr != nil {
			err = rerr
			break
		}
		t.Close()
		t = next.t
		if samples != nil {
			samples.Gen = j.generation
		}
		if sink.file == nil && j.rank == 0 && j.member != nil {
			if mw, release := j.takeOverRunDir(); mw != nil {
				defer release() // once: sink.file is set from here on
				sink.file = mw
			}
		}
		pending.hold(next.rec, sink)
	}
	if ferr := flushReform(pending); err == nil {
		err = ferr
	}
	if sink.file != nil && sink.members != nil {
		_ = sink.file.Write(sink.members.Final(res.Steps, time.Now())) // a failed write shows at Close
	}
	if sink.file != nil && err != nil {
		_ = sink.file.Write(stoppedRecord(res, err)) // why the run ended early, for the dashboard
	}
	if sink.file != nil {
		// Close writes the records still buffered: the last chance to find a full disk.
		if cerr := sink.file.Close(); cerr != nil && (err == nil || res.Interrupted) {
			log.Error("writing the metrics failed", zap.String("file", sink.file.Path()), zap.Error(cerr))
			if err == nil {
				err = cerr
			}
		}
	}
	if sink.monitors != nil {
		if cerr := sink.monitors.Close(); cerr != nil && (err == nil || res.Interrupted) {
			log.Error("writing the TensorBoard or CSV files failed", zap.Error(cerr))
			if err == nil {
				err = cerr
			}
		}
	}
	if j.logErr != nil {
		if lerr := j.logErr(); lerr != nil && !errors.Is(err, lerr) {
			log.Error("writing the log failed", zap.String("file", cfg.LogPath()), zap.Error(lerr))
			if err == nil {
				err = lerr
			}
		}
	}
	acc := zap.Float64("test_accuracy", res.TestAccuracy)
	if res.AlreadyFinished {
		acc = zap.Bool("already_finished", true) // nothing was evaluated
	}
	log.Info("finished", zap.Duration("elapsed", time.Since(start).Round(time.Millisecond)), zap.Int64("steps", res.Steps), acc,
		zap.Float64s("epoch_seconds", res.EpochSeconds), zap.Int64("skipped_steps", res.Skipped),
		zap.Int64("oom_skipped_micro_batches", res.SkippedMicroBatches), zap.Int("micro_batch", res.MicroBatch), zap.Int("accum", res.Accum))
	return res, err
}

// metricsBytesPerStep bounds what a step adds to the run directory, for the free-space check
// at the start: a train record in metrics.jsonl (about 650 bytes with the CPU engine's
// memory figures), an evaluation's share and train.log's periodic lines.
const metricsBytesPerStep = 1 << 10

// stepSink forwards metrics to the file (rank 0) and the training step to the gossip
// metadata, so `qvd status` shows how far each member is.
type stepSink struct {
	file   *metrics.Writer
	node   *cluster.Node
	logErr func() error // the log file's first write error (nil: no log file)
	prom   *promexport.Exporter
	// monitors writes the TensorBoard and CSV files (rank 0; nil elsewhere).
	monitors *monitor.Sink
	// members writes rank 0's view of the members to the file now and then, for
	// qvd dashboard RUN_DIR (rank 0 of a multi-node job; nil elsewhere).
	members *dashboard.MembersLog
}

func (s stepSink) Write(r metrics.Record) error {
	if s.logErr != nil {
		if err := s.logErr(); err != nil {
			return err
		}
	}
	if s.node != nil && r.Kind == metrics.KindTrain {
		s.node.SetStep(r.Step)
		var total int64
		for _, b := range r.Memory {
			total += b
		}
		s.node.SetModelBytes(uint64(total))
		gossipMemory(s.node, r)
	}
	if s.prom != nil {
		_ = s.prom.Write(r) // never fails
	}
	if s.file != nil {
		if err := s.file.Write(r); err != nil {
			return err
		}
		if mr, due := s.membersDue(r); due {
			if err := s.file.Write(mr); err != nil {
				return err
			}
		}
	}
	if s.monitors != nil {
		return s.monitors.Write(r)
	}
	return nil
}

// lastEvaluation describes the last evaluation at or before step in the metrics file, for a
// run that has nothing left to train.
func lastEvaluation(path string, step int64) string {
	recs, err := metrics.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("no evaluation to show (%v)", err)
	}
	for i := len(recs) - 1; i >= 0; i-- {
		if r := recs[i]; r.Kind == metrics.KindEval && r.Step <= step {
			return fmt.Sprintf("last evaluation at step %d: test accuracy %.4f, test loss %.4f", r.Step, r.Accuracy, r.Loss)
		}
	}
	return "no evaluation recorded in " + path
}

// reformSink is a re-formed generation's metrics sink: it holds the re-form's record until
// the first step at the new world completes, so that resume_seconds spans the issue's
// "time to resume" — from the loss to training again — rather than the re-form alone.
type reformSink struct {
	next trainer.MetricsSink
	lost time.Time // when the survivor's step failed

	mu  sync.Mutex
	rec *metrics.Record // the re-form's record, not yet written
}

// hold keeps rec until the first completed step, which it writes with everything after to
// next (the sink of the new generation, which may now hold the run directory).
func (s *reformSink) hold(rec metrics.Record, next trainer.MetricsSink) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.rec, s.next = &rec, next
}

func (s *reformSink) Write(r metrics.Record) error {
	s.mu.Lock()
	next, rec := s.next, s.rec
	if r.Kind == metrics.KindTrain {
		s.rec = nil
	} else {
		rec = nil
	}
	s.mu.Unlock()
	if rec != nil {
		rec.ResumeSeconds = time.Since(s.lost).Seconds()
		if err := next.Write(*rec); err != nil {
			return err
		}
	}
	return next.Write(r)
}

// flushReform writes a re-form's record that no step followed (the run ended first),
// without resume_seconds.
func flushReform(s *reformSink) error {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	next, rec := s.next, s.rec
	s.rec = nil
	s.mu.Unlock()
	if rec == nil {
		return nil
	}
	rec.ResumeSeconds = 0
	return next.Write(*rec)
}
