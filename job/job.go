package job

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.yaml.in/yaml/v3"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/progress"
	"github.com/qvd/qvd/rundir"
	"github.com/qvd/qvd/trainer"
)

// Options are how this process takes part in its job, beyond the configuration.
type Options struct {
	// Stdout gets rank 0's progress line and summary, Stderr the log; nil discards.
	Stdout, Stderr io.Writer
	LogLevel       zapcore.Level
	Quiet          bool // no progress line
	// Resume is a checkpoint directory, "auto" (the newest valid one in checkpoint.dir) or ""
	// (start fresh); rank 0 resolves it.
	Resume string
	// ResumeHint is the command line that resumes the run, printed on an interrupt ("":
	// another process prints it).
	ResumeHint string
	// Warnings are the configuration's (configs.DeepSpeedResult, the auto micro-batch),
	// logged once the log is open.
	Warnings []string
	// RunDir is rank 0's run directory, opened and locked by the caller, which closes it
	// after Run: Run logs what opening it took over or moved aside.
	RunDir *rundir.Run
	// MetricsAddr is this worker's own Prometheus address ("": monitoring.metrics_addr with
	// the port offset by the rank).
	MetricsAddr string
	// LookupEnv reads GOGC and the local-rank variables (LocalRank); nil is an empty
	// environment.
	LookupEnv func(string) (string, bool)

	// The job's group; with none of these the process trains alone.
	//
	// Coordinator makes this process rank 0 of a job of Nodes processes, the others joining
	// through the member it starts.
	Coordinator *Coordinator
	// Worker is a member that has joined and received its roster (AwaitJob); the caller
	// closes the member after Run.
	Worker *Worker
	// Comm is a ready communicator (an in-process group in tests): this process is rank
	// Comm.Rank() of Comm.Size(). Run does not close it.
	Comm collective.Communicator
	// Membership, with Comm and elastic.min_nodes > 0, is the in-process group's elastic
	// membership (tests): how this rank learns of lost members and re-forms without them.
	// A cluster member (Coordinator, Worker) has its own.
	Membership Membership
}

// Coordinator is Options.Coordinator.
type Coordinator struct {
	Nodes  int
	Member MemberOptions
}

// Worker is Options.Worker.
type Worker struct {
	Member *Member
	Roster *cluster.Roster
}

// job is one process's part of a training run.
type job struct {
	cfg         configs.Config
	resume      string
	rank, world int
	comm        collective.Communicator
	plane       *DataPlane             // the communicator and its transports, when the job built them
	wire        *collective.WireCounts // the transport's byte counters (nil: none)
	metricsAddr string                 // this worker's own metrics address ("": the job's, see serveMetrics)
	member      *Member
	roster      *cluster.Roster
	mem         Membership // Options.Membership
	closeGen    func()     // releases a re-formed generation's communicator (nil: none)
	// baseWorld is the world the configured micro-batch × accumulation was set for: the first
	// generation's (an elastic job keeps its global batch from there; see elastic.Accum).
	baseWorld int
	// generation is the group's generation (the roster's Gen; 0 in one process) and
	// noAdmitUntil holds off admitting members after a re-form that admitted none of them.
	generation   uint64
	noAdmitUntil time.Time
	// trained is the roster of the generation that last trained, while the job re-forms.
	trained   *cluster.Roster
	getenv    func(string) string
	lookupEnv func(string) (string, bool)

	stdout   io.Writer
	line     *progress.Line
	log      *zap.Logger
	closeLog func()
	logErr   func() error // the first failed write to the log file
	// resumeHint is the command line that resumes this run, printed on an interrupt ("":
	// another process prints it).
	resumeHint string
}

// Run trains cfg as this process's part of its job: it opens the log and the progress line,
// forms or joins the group opts names, builds the engine, data, sinks and trainer, runs it
// and prints rank 0's summary. The error, once the log is open, has been logged; a run
// stopped by ctx returns a Result with Interrupted set, after saving a checkpoint.
// Configuration errors are configs.ErrInvalid.
func Run(ctx context.Context, cfg configs.Config, opts Options) (trainer.Result, error) {
	j := &job{cfg: cfg, resume: opts.Resume, world: 1, metricsAddr: opts.MetricsAddr, resumeHint: opts.ResumeHint,
		lookupEnv: opts.LookupEnv, stdout: opts.Stdout}
	if j.lookupEnv == nil {
		j.lookupEnv = func(string) (string, bool) { return "", false }
	}
	j.getenv = func(k string) string { v, _ := j.lookupEnv(k); return v }
	if j.stdout == nil {
		j.stdout = io.Discard
	}
	switch {
	case opts.Coordinator != nil:
		j.world = opts.Coordinator.Nodes
	case opts.Worker != nil:
		j.rank, j.world = opts.Worker.Roster.Rank, opts.Worker.Roster.World
	case opts.Comm != nil:
		j.rank, j.world, j.comm, j.mem = opts.Comm.Rank(), opts.Comm.Size(), opts.Comm, opts.Membership
	}
	if e := cfg.Elastic; e.Enabled() && j.world > 1 && (j.world < e.MinNodes || j.world > e.MaxNodes) {
		return trainer.Result{}, invalid(fmt.Errorf("elastic: the job has %d members, outside [min_nodes %d, max_nodes %d]", j.world, e.MinNodes, e.MaxNodes))
	}
	if err := j.setup(opts); err != nil {
		return trainer.Result{}, err
	}
	defer j.closeLog()
	for _, w := range opts.Warnings {
		j.log.Warn(w)
	}
	if rd := opts.RunDir; rd != nil {
		for _, s := range rd.Stale {
			j.log.Warn("took over a stale run directory lock: the process that held it is no longer running", zap.String("lock", s.File),
				zap.Int("pid", s.Holder.PID), zap.String("host", s.Holder.Host), zap.Time("since", s.Holder.Since))
		}
		for _, m := range rd.MovedAside {
			j.log.Warn("--overwrite: moved the previous run aside", zap.String("from", m.From), zap.String("to", m.To))
		}
		j.log.Info("run directory", zap.String("out", cfg.Run.Out), zap.String("run_id", rd.ID))
	}
	switch {
	case opts.Coordinator != nil && opts.Coordinator.Nodes > 1:
		m, err := StartMember(cfg.Cluster, cfg.TLS, cluster.RoleCoordinator, NewJobID(cfg.Run.Name), opts.Coordinator.Member, j.log)
		if err != nil {
			return trainer.Result{}, j.fail(err)
		}
		defer m.Close()
		roster, err := j.coordinate(ctx, m)
		if err != nil {
			return trainer.Result{}, j.fail(err)
		}
		if err := j.attach(ctx, m, roster); err != nil {
			return trainer.Result{}, j.fail(err)
		}
	case opts.Worker != nil:
		if err := j.attach(ctx, opts.Worker.Member, opts.Worker.Roster); err != nil {
			return trainer.Result{}, j.fail(err)
		}
	}
	return j.run(ctx)
}

// setup creates the run directory (rank 0), the progress line (rank 0) and the logger.
func (j *job) setup(opts Options) error {
	logPath := ""
	if j.rank == 0 {
		if err := os.MkdirAll(j.cfg.Run.Out, 0o755); err != nil {
			return fmt.Errorf("creating run directory: %w", err)
		}
		logPath = j.cfg.LogPath()
	}
	// Progress on stdout (rank 0 only); logs on stderr (through the progress line when both
	// are the same terminal, so they do not interleave) and, on rank 0, as JSON in the run
	// directory.
	logOut := opts.Stderr
	if logOut == nil {
		logOut = io.Discard
	}
	if !opts.Quiet && j.rank == 0 {
		tty := false
		if fo, ok := j.stdout.(*os.File); ok {
			tty = progress.IsTerminal(fo)
		}
		j.line = progress.New(j.stdout, progress.Config{TTY: tty})
		if fe, ok := logOut.(*os.File); ok && tty && progress.IsTerminal(fe) {
			logOut = j.line.LogWriter(fe)
		}
	}
	lg, err := NewLogger(logOut, logPath, opts.LogLevel)
	if err != nil {
		return err
	}
	j.log, j.closeLog, j.logErr = lg.Log, lg.Close, lg.Err
	if j.world > 1 {
		j.log = j.log.With(zap.Int("rank", j.rank))
	}
	return nil
}

// coordinate waits on m for the job's other members and sends them the roster with the
// job's config.
func (j *job) coordinate(ctx context.Context, m *Member) (*cluster.Roster, error) {
	text, err := yaml.Marshal(j.cfg)
	if err != nil {
		return nil, fmt.Errorf("encoding the job config: %w", err)
	}
	jobID := m.node.LocalMeta().Job
	j.log.Info("waiting for workers", zap.Int("nodes", j.world), zap.String("job", jobID),
		zap.String("join_with", "qvd join "+m.node.LocalAddr()))
	return m.node.Coordinate(ctx, jobID, j.world, text)
}

// attach connects the job to its group: the communicator over the roster, and the
// failure watcher. Each generation's data plane is named apart (genJob), so that an elastic
// job's next generation — survivors and newcomers alike — never meets the old one's
// transports, which may still be draining on the shared listeners.
func (j *job) attach(ctx context.Context, m *Member, r *cluster.Roster) error {
	j.member, j.roster, j.generation = m, r, r.Gen
	_ = m.node.UpdateMeta(func(meta *cluster.Meta) { meta.Rank = r.Rank; meta.Job = r.Job })
	dr := r.Clone()
	dr.Job = genJob(r.Job, r.Gen)
	d, err := m.Communicator(ctx, dr, j.cfg.Collective)
	if err != nil {
		return err
	}
	if j.cfg.Collective.Transport == collective.TransportNCCL {
		nc, err := NCCLOver(ctx, d.Comm, LocalRank(j.getenv, r.Rank), j.cfg.Device)
		if err != nil {
			d.Close()
			return err
		}
		d.Comm = nc // it closes the ring it was bootstrapped from
	} else {
		j.wire = d.Wire // NCCL's traffic bypasses the transport, which only bootstrapped it
	}
	j.comm, j.plane = d.Comm, d
	j.log.Info("joined the job", zap.String("job", r.Job), zap.Int("world", r.World),
		zap.String("transport", j.cfg.Collective.Transport), zap.String("data_plane", string(d.Plan)))
	return nil
}

// fail logs err as the job's failure and returns it.
func (j *job) fail(err error) error {
	j.log.Error("failed", zap.Error(err))
	return err
}

// run trains and reports; every exit path releases the communicator it built.
func (j *job) run(ctx context.Context) (trainer.Result, error) {
	defer j.closeComm()
	res, err := j.train(ctx)
	switch {
	case err == nil:
	case res.Interrupted:
		j.log.Warn("stopped by signal", zap.String("checkpoint", res.Checkpoint))
		if j.rank == 0 && j.resumeHint != "" {
			fmt.Fprintf(j.stdout, "interrupted at step %d; resume with: %s\n", res.Steps, j.resumeHint)
		} else if j.rank == 0 {
			fmt.Fprintf(j.stdout, "interrupted at step %d\n", res.Steps)
		}
		return res, err
	default:
		return res, j.fail(fmt.Errorf("training failed: %w", err))
	}
	if j.rank != 0 {
		j.log.Info("done", zap.Int64("steps", res.Steps), zap.String("weights_sha256", res.WeightsSHA256))
		return res, nil
	}
	if res.AlreadyFinished {
		fmt.Fprintf(j.stdout, "already finished at step %d (the run ends at step %d): nothing to train; %s\n",
			res.Steps, res.TotalSteps, lastEvaluation(j.cfg.MetricsPath(), res.Steps))
		if res.Checkpoint != "" {
			fmt.Fprintf(j.stdout, "checkpoint: %s\n", res.Checkpoint)
		}
		return res, nil
	}
	fmt.Fprintf(j.stdout, "done: %d steps (%.2f epochs), test accuracy %.4f, test loss %.4f\n", res.Steps, res.Epoch, res.TestAccuracy, res.TestLoss)
	j.log.Info("done", zap.Int64("steps", res.Steps), zap.String("weights_sha256", res.WeightsSHA256))
	if res.Checkpoint != "" {
		fmt.Fprintf(j.stdout, "checkpoint: %s\n", res.Checkpoint)
	}
	fmt.Fprintf(j.stdout, "metrics:    %s  (plot: qvd plot %s)\n", j.cfg.MetricsPath(), j.cfg.Run.Out)
	if tb := j.cfg.TensorBoard; tb.Enabled {
		fmt.Fprintf(j.stdout, "tensorboard: tensorboard --logdir %s\n", tb.Dir)
	}
	return res, nil
}

// invalid marks err as a configuration error (configs.ErrInvalid) without changing its text.
func invalid(err error) error { return invalidError{err} }

type invalidError struct{ err error }

func (e invalidError) Error() string        { return e.err.Error() }
func (e invalidError) Unwrap() error        { return e.err }
func (e invalidError) Is(target error) bool { return target == configs.ErrInvalid }
