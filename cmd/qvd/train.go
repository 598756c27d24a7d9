package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.yaml.in/yaml/v3"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/blas"
	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/monitor"
	"github.com/qvd/qvd/internal/progress"
	"github.com/qvd/qvd/internal/promexport"
	"github.com/qvd/qvd/internal/version"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/rundir"
	"github.com/qvd/qvd/trainer"
)

// runFlags are the flags shared by `train` and `config`: where the config comes from and the
// fields a flag may override (flags win over the DeepSpeed JSON, which wins over the YAML).
type runFlags struct {
	fs                      *flag.FlagSet
	config, deepspeed       string
	micro, accum, epochs    int
	effective               int
	precision, out          string
	lr                      float64
	seed                    uint64
	maxSteps                int64
	threads                 int
	trainSubset, testSubset int
	dataPath                string
	transport               string
	device                  string
	engine                  string
	zeroStage               int
	checkpointEvery         int
	offload                 string
	activationCheckpointing int
	metricsAddr             string
	dashboardAddr           string
}

func newRunFlags(name string, stderr io.Writer) *runFlags {
	f := &runFlags{fs: newFlagSet(name)}
	fs := f.fs
	fs.StringVar(&f.config, "c", "", "config: a YAML file, or the name of an embedded config ("+fmt.Sprint(configs.Embedded())+"); default "+configs.DefaultName)
	fs.StringVar(&f.config, "config", "", "same as -c")
	fs.StringVar(&f.deepspeed, "deepspeed", "", "a DeepSpeed ds_config.json applied over the config")
	fs.Var((*microBatchFlag)(&f.micro), "micro-batch", "samples per forward/backward, or auto: the largest that fits the memory budget (train.micro_batch)")
	fs.IntVar(&f.effective, "effective-batch", 0, "global batch micro-batch auto keeps: micro × accum × world (train.effective_batch)")
	fs.IntVar(&f.accum, "accum", 0, "micro-batches per optimizer step (train.accum)")
	fs.StringVar(&f.precision, "precision", "", "fp32, fp16 or bf16 (train.precision)")
	fs.IntVar(&f.epochs, "epochs", 0, "epochs to train (train.epochs)")
	fs.Float64Var(&f.lr, "lr", 0, "base learning rate (optimizer.lr)")
	fs.StringVar(&f.out, "out", "", "run directory for metrics, logs and checkpoints (run.out)")
	fs.Uint64Var(&f.seed, "seed", 0, "random seed for initialisation and data order (run.seed)")
	fs.Int64Var(&f.maxSteps, "max-steps", 0, "stop after this many optimizer steps (train.max_steps)")
	fs.IntVar(&f.threads, "threads", 0, "threads for BLAS and the optimizer (train.threads; 0 = all cores)")
	fs.IntVar(&f.trainSubset, "train-subset", 0, "train on the first N samples only (data.train_subset)")
	fs.IntVar(&f.testSubset, "test-subset", 0, "evaluate on the first N test samples only (data.test_subset)")
	fs.StringVar(&f.dataPath, "data", "", "dataset directory (data.path)")
	fs.StringVar(&f.transport, "transport", "", "data path between processes: auto (shared memory within a host, TCP across), shm, tcp, grpc or nccl (collective.transport)")
	fs.StringVar(&f.device, "device", "", "where the engine runs: cpu, cuda (a qvd built with -tags cuda) or reference (the plain-Go reference device) (device.type)")
	fs.StringVar(&f.engine, "engine", "", "native (qvd's layer engine) or gorgonia (the gorgonia graphs, CPU only) (engine)")
	fs.IntVar(&f.zeroStage, "zero-stage", 0, "ZeRO stage 0, 1 or 2 (zero_optimization.stage)")
	fs.StringVar(&f.offload, "offload", "", "optimizer state and step in host memory: none or cpu (zero_optimization.offload_optimizer.device)")
	fs.IntVar(&f.checkpointEvery, "checkpoint-every", 0, "write a checkpoint every N steps (checkpoint.every_steps; 0 = only at the end and on Ctrl-C)")
	fs.IntVar(&f.activationCheckpointing, "activation-checkpointing", 0, "recompute activations in this many segments to save memory; 0 or 1 = off (model.activation_checkpointing.segments)")
	fs.StringVar(&f.metricsAddr, "metrics-addr", "", "serve Prometheus metrics on HOST:PORT/metrics; rank r of a job uses PORT+r, PORT 0 a free port each (monitoring.metrics_addr)")
	fs.StringVar(&f.dashboardAddr, "dashboard-addr", "", "serve the live dashboard (as qvd dashboard does) on HOST:PORT while training, from rank 0; PORT 0 a free port (dashboard.addr)")
	return f
}

// resolve builds the run's configuration for one process.
func (f *runFlags) resolve() (configs.Config, []string, error) { return f.resolveWorld(1) }

// resolveWorld builds the run's configuration: defaults, YAML, DeepSpeed JSON, flags; then
// derived defaults and validation, for a job of world processes.
func (f *runFlags) resolveWorld(world int) (configs.Config, []string, error) {
	name := f.config
	if name == "" {
		name = configs.DefaultName
	}
	cfg, err := configs.Load(name)
	if err != nil {
		return cfg, nil, err
	}
	var ds configs.DeepSpeedResult
	if f.deepspeed != "" {
		if ds, err = configs.LoadDeepSpeed(&cfg, f.deepspeed); err != nil {
			return cfg, nil, err
		}
	}
	f.fs.Visit(func(fl *flag.Flag) {
		switch fl.Name {
		case "micro-batch":
			cfg.Train.MicroBatch, ds.MicroSet = f.micro, true
		case "effective-batch":
			cfg.Train.EffectiveBatch = f.effective
		case "accum":
			cfg.Train.Accum, ds.AccumSet = f.accum, true
		case "precision":
			cfg.Train.Precision = f.precision
		case "epochs":
			cfg.Train.Epochs = f.epochs
		case "lr":
			cfg.Optimizer.LR = f.lr
		case "out":
			cfg.Run.Out = f.out
		case "seed":
			cfg.Run.Seed = f.seed
		case "max-steps":
			cfg.Train.MaxSteps = f.maxSteps
		case "threads":
			cfg.Train.Threads = f.threads
			cfg.Optimizer.Threads = f.threads
		case "train-subset":
			cfg.Data.TrainSubset = f.trainSubset
		case "test-subset":
			cfg.Data.TestSubset = f.testSubset
		case "data":
			cfg.Data.Path = f.dataPath
		case "transport":
			cfg.Collective.Transport = f.transport
		case "device":
			cfg.Device.Type = f.device
		case "engine":
			cfg.Engine = f.engine
		case "zero-stage":
			cfg.Zero.Stage = f.zeroStage
		case "checkpoint-every":
			cfg.Checkpoint.EverySteps = f.checkpointEvery
		case "offload":
			cfg.Zero.OffloadOptimizer.Device = f.offload
		case "activation-checkpointing":
			cfg.Model.ActivationCheckpointing.Segments = f.activationCheckpointing
		case "metrics-addr":
			cfg.Monitoring.MetricsAddr = f.metricsAddr
		case "dashboard-addr":
			cfg.Dashboard.Addr = f.dashboardAddr
		}
	})
	if err := ds.CheckBatch(&cfg, world); err != nil {
		return cfg, nil, err
	}
	auto, err := resolveAutoMicro(&cfg, world)
	if err != nil {
		return cfg, nil, fmt.Errorf("%w: %w", configs.ErrInvalid, err)
	}
	if auto != nil {
		ds.Warnings = append(ds.Warnings, fmt.Sprintf("micro_batch: auto chose micro-batch %d × accum %d × %d worker(s) = %d (budget %s per worker from %s, model states %s, activations %s per sample measured; the Go heap at the probe at %d: %s)",
			auto.micro, auto.accum, world, cfg.Train.EffectiveBatch, humanBytes(auto.budget), auto.budgetFrom, humanBytes(auto.states), humanBytes(auto.perSample), auto.micro, humanBytes(auto.probed)))
	}
	cfg.Resolve()
	if err := cfg.Validate(); err != nil {
		return cfg, nil, fmt.Errorf("%w:\n  %w", configs.ErrInvalid, err)
	}
	return cfg, ds.Warnings, nil
}

func cmdConfig(args []string, stdout, stderr io.Writer) int {
	f := newRunFlags("config", stderr)
	if code, ok := parseFlags(f.fs, args, stdout, stderr); !ok {
		return code
	}
	cfg, warns, err := f.resolve()
	if err != nil {
		fmt.Fprintf(stderr, "qvd config: %v\n", err)
		return exitUsage
	}
	for _, w := range warns {
		fmt.Fprintf(stderr, "warning: %s\n", w)
	}
	enc := yaml.NewEncoder(stdout)
	enc.SetIndent(2)
	if err := enc.Encode(cfg); err != nil {
		fmt.Fprintf(stderr, "qvd config: %v\n", err)
		return exitFailure
	}
	return exitOK
}

func cmdTrain(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	f := newRunFlags("train", stderr)
	var o outputFlags
	o.register(f.fs)
	var resume string
	var nodes int
	var mf memberFlags
	f.fs.StringVar(&resume, "resume", "", `continue from a checkpoint directory, or "auto" for the newest valid one in checkpoint.dir (none: start fresh)`)
	var overwrite bool
	f.fs.BoolVar(&overwrite, "overwrite", false, "start a new run in a run directory that holds another run: its contents move to <out>.old-<time> (nothing is deleted)")
	f.fs.IntVar(&nodes, "nodes", 1, "number of processes in the job: > 1 makes this the coordinating member, which waits for nodes-1 workers to run qvd join")
	mf.register(f.fs)
	if code, ok := parseFlags(f.fs, args, stdout, stderr); !ok {
		return code
	}
	if f.fs.NArg() > 0 {
		fmt.Fprintf(stderr, "qvd train: unexpected argument %q (flags only)\n", f.fs.Arg(0))
		return exitUsage
	}
	if code, handled := envTrain(ctx, f, &nodes, &mf, o, stdout, stderr); handled {
		return code
	}
	if nodes < 1 || nodes > 65535 {
		fmt.Fprintf(stderr, "qvd train: --nodes must be in [1, 65535], got %d\n", nodes)
		return exitUsage
	}
	cfg, warns, err := f.resolveWorld(nodes)
	if err != nil {
		fmt.Fprintf(stderr, "qvd train: %v\n", err)
		return exitUsage
	}
	// From here the run owns its directory: locked against a second run, checked for another
	// run's checkpoints and metrics, its run id recorded. Only rank 0 opens it; the workers
	// of the job write their shards under its lock.
	rd, err := rundir.Open(rundir.Options{Dir: cfg.Run.Out, CheckpointDir: cfg.Checkpoint.Dir,
		MetricsFile: cfg.MetricsPath(), Resume: resume, Overwrite: overwrite})
	if err != nil {
		fmt.Fprintf(stderr, "qvd train: %v\n", err)
		if errors.Is(err, rundir.ErrInvalidOptions) || errors.Is(err, rundir.ErrRunExists) || errors.Is(err, checkpoint.ErrOtherRun) {
			return exitUsage
		}
		return exitFailure
	}
	defer rd.Close()
	j := &job{cfg: cfg, resume: resume, rank: 0, world: nodes}
	if os.Getenv(launchedEnv) == "" { // under qvd launch, the launcher prints the hint
		j.resumeHint = resumeCommand(progName()+" train", args)
	}
	if code := o.setup(j, stdout, stderr); code != exitOK {
		return code
	}
	defer j.closeLog()
	for _, w := range warns {
		j.log.Warn(w)
	}
	for _, s := range rd.Stale {
		j.log.Warn("took over a stale run directory lock: the process that held it is no longer running", zap.String("lock", s.File),
			zap.Int("pid", s.Holder.PID), zap.String("host", s.Holder.Host), zap.Time("since", s.Holder.Since))
	}
	for _, m := range rd.MovedAside {
		j.log.Warn("--overwrite: moved the previous run aside", zap.String("from", m.From), zap.String("to", m.To))
	}
	j.log.Info("run directory", zap.String("out", cfg.Run.Out), zap.String("run_id", rd.ID))
	if nodes > 1 {
		m, err := startMember(cfg.Cluster, cfg.TLS, cluster.RoleCoordinator, newJobID(cfg.Run.Name), mf, j.log)
		if err != nil {
			return j.fail(stderr, err)
		}
		defer m.Close()
		text, err := yaml.Marshal(cfg)
		if err != nil {
			return j.fail(stderr, fmt.Errorf("encoding the job config: %w", err))
		}
		jobID := m.node.LocalMeta().Job
		j.log.Info("waiting for workers", zap.Int("nodes", nodes), zap.String("job", jobID),
			zap.String("join_with", "qvd join "+m.node.LocalAddr()))
		roster, err := m.node.Coordinate(ctx, jobID, nodes, text)
		if err != nil {
			return j.fail(stderr, err)
		}
		if code := j.attach(ctx, m, roster, stderr); code != exitOK {
			return code
		}
	}
	return j.run(ctx, stdout, stderr)
}

// cmdJoin starts a worker: it joins the cluster through any member, receives the job's
// configuration and its rank from the coordinator, and trains.
func cmdJoin(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("join")
	var o outputFlags
	o.register(fs)
	var mf memberFlags
	mf.register(fs)
	dataPath := fs.String("data", "", "dataset directory on this machine (overrides the job's data.path)")
	fs.StringVar(&o.metricsAddr, "metrics-addr", "", "serve this worker's Prometheus metrics on HOST:PORT/metrics, as given (default: the job's monitoring.metrics_addr, port + rank)")
	peer, code, ok := parseOneArg(fs, args, stdout, stderr)
	if !ok {
		return code
	}
	if err := (promexport.Config{MetricsAddr: o.metricsAddr}).Validate(); err != nil {
		fmt.Fprintf(stderr, "qvd join: --metrics-addr: %v\n", err)
		return exitUsage
	}
	return joinJob(ctx, peer, o, mf, *dataPath, stdout, stderr)
}

// joinJob is a worker after its flags: `qvd join`, and a SLURM task other than task 0.
// dataPath, if not empty, overrides the job's data.path on this machine.
func joinJob(ctx context.Context, peer string, o outputFlags, mf memberFlags, dataPath string, stdout, stderr io.Writer) int {
	// Until the roster arrives the worker has no config: log to stderr only.
	boot, err := newLogger(stderr, "", zapcore.InfoLevel)
	if err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		return exitFailure
	}
	m, err := startMember(configs.Default().Cluster, cluster.TLSConfig{}, cluster.RoleWorker, "", mf, boot.log)
	if err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		return exitUsage
	}
	defer m.Close()
	if err := joinWithRetry(ctx, m, peer, configs.Default().Cluster.RendezvousTimeout, boot.log); err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		return exitFailure
	}
	boot.log.Info("joined; waiting for the coordinator's roster", zap.String("peer", peer))
	roster, err := m.node.AwaitRoster(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		return exitFailure
	}
	cfg, err := configs.Parse(roster.Config, "the coordinator's config")
	if err == nil && dataPath != "" {
		cfg.Data.Path = dataPath
	}
	if err == nil {
		cfg.TLS = m.tlsCfg // the coordinator's paths mean nothing here
		err = cfg.Validate()
	}
	if err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		return exitUsage
	}
	j := &job{cfg: cfg, rank: roster.Rank, world: roster.World, metricsAddr: o.metricsAddr}
	if code := o.setup(j, stdout, stderr); code != exitOK {
		return code
	}
	defer j.closeLog()
	if code := j.attach(ctx, m, roster, stderr); code != exitOK {
		return code
	}
	return j.run(ctx, stdout, stderr)
}

// outputFlags control where a job's progress and logs go.
type outputFlags struct {
	logLevel string
	quiet    bool
	// metricsAddr is a worker's own metrics address (`qvd join --metrics-addr`); the
	// coordinator's goes into the job's config (monitoring.metrics_addr).
	metricsAddr string
}

func (o *outputFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.BoolVar(&o.quiet, "quiet", false, "no progress line")
}

func (mf *memberFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&mf.bind, "bind", "", "gossip address host:port of this node (default cluster.bind, 0.0.0.0:7946); gRPC listens on port+1")
	fs.StringVar(&mf.grpcBind, "grpc-bind", "", "gRPC address host:port (default: the --bind host, gossip port + 1; port 0 picks a free one)")
	fs.StringVar(&mf.advertise, "advertise", "", "address other nodes should use to reach this one (default: derived from --bind)")
	fs.StringVar(&mf.nodeName, "node-name", "", "this node's unique name (default: hostname and a random suffix)")
	fs.StringVar(&mf.keyFile, "cluster-key-file", "", "file holding the cluster key (default: $"+clusterKeyEnv+")")
	mf.tls.register(fs)
}

// job is one process's part of a training run.
type job struct {
	cfg         configs.Config
	resume      string
	rank, world int
	comm        collective.Communicator
	plane       *dataPlane             // the communicator and its transports
	wire        *collective.WireCounts // the transport's byte counters (nil: none)
	metricsAddr string                 // this worker's own metrics address ("": the job's, see serveMetrics)
	member      *member
	roster      *cluster.Roster

	line     *progress.Line
	log      *zap.Logger
	closeLog func()
	logErr   func() error // the first failed write to the log file
	// resumeHint is the command line that resumes this run, printed on an interrupt ("":
	// another process prints it).
	resumeHint string
}

// setup creates the run directory (rank 0), the progress line (rank 0) and the logger.
func (o *outputFlags) setup(j *job, stdout, stderr io.Writer) int {
	var level zapcore.Level
	if err := level.Set(o.logLevel); err != nil {
		fmt.Fprintf(stderr, "qvd: --log-level: %v\n", err)
		return exitUsage
	}
	logPath := ""
	if j.rank == 0 {
		if err := os.MkdirAll(j.cfg.Run.Out, 0o755); err != nil {
			fmt.Fprintf(stderr, "qvd: creating run directory: %v\n", err)
			return exitFailure
		}
		logPath = j.cfg.LogPath()
	}
	// Progress on stdout (rank 0 only); logs on stderr (through the progress line when both
	// are the same terminal, so they do not interleave) and, on rank 0, as JSON in the run
	// directory.
	logOut := stderr
	if !o.quiet && j.rank == 0 {
		tty := false
		if fo, ok := stdout.(*os.File); ok {
			tty = progress.IsTerminal(fo)
		}
		j.line = progress.New(stdout, progress.Config{TTY: tty})
		if fe, ok := stderr.(*os.File); ok && tty && progress.IsTerminal(fe) {
			logOut = j.line.LogWriter(stderr)
		}
	}
	lg, err := newLogger(logOut, logPath, level)
	if err != nil {
		fmt.Fprintf(stderr, "qvd: %v\n", err)
		return exitFailure
	}
	j.log, j.closeLog, j.logErr = lg.log, lg.close, lg.err
	if j.world > 1 {
		j.log = j.log.With(zap.Int("rank", j.rank))
	}
	return exitOK
}

// attach connects the job to its group: the communicator over the roster, and the
// failure watcher.
func (j *job) attach(ctx context.Context, m *member, r *cluster.Roster, stderr io.Writer) int {
	j.member, j.roster = m, r
	_ = m.node.UpdateMeta(func(meta *cluster.Meta) { meta.Rank = r.Rank; meta.Job = r.Job })
	d, err := m.communicator(ctx, r, j.cfg.Collective)
	if err != nil {
		return j.fail(stderr, err)
	}
	if j.cfg.Collective.Transport == "nccl" {
		nc, err := ncclOver(ctx, d.comm, r.Rank, j.cfg.Device)
		if err != nil {
			d.Close()
			return j.fail(stderr, err)
		}
		d.comm = nc // it closes the ring it was bootstrapped from
	} else {
		j.wire = d.wire // NCCL's traffic bypasses the transport, which only bootstrapped it
	}
	j.comm, j.plane = d.comm, d
	j.log.Info("joined the job", zap.String("job", r.Job), zap.Int("world", r.World),
		zap.String("transport", j.cfg.Collective.Transport), zap.String("data_plane", string(d.plan)))
	return exitOK
}

func (j *job) fail(stderr io.Writer, err error) int {
	j.log.Error("failed", zap.Error(err))
	fmt.Fprintf(stderr, "qvd: %v\n", err)
	if errors.Is(err, configs.ErrInvalid) {
		return exitUsage
	}
	return exitFailure
}

// run trains and reports; every exit path releases the communicator.
func (j *job) run(ctx context.Context, stdout, stderr io.Writer) int {
	defer func() {
		if j.plane != nil {
			j.plane.Close()
		}
	}()
	res, err := j.train(ctx)
	switch {
	case err == nil:
	case res.Interrupted:
		j.log.Warn("stopped by signal", zap.String("checkpoint", res.Checkpoint))
		if j.rank == 0 && j.resumeHint != "" {
			fmt.Fprintf(stdout, "interrupted at step %d; resume with: %s\n", res.Steps, j.resumeHint)
		} else if j.rank == 0 {
			fmt.Fprintf(stdout, "interrupted at step %d\n", res.Steps)
		}
		return exitInterrupted
	default:
		return j.fail(stderr, fmt.Errorf("training failed: %w", err))
	}
	if j.rank != 0 {
		j.log.Info("done", zap.Int64("steps", res.Steps), zap.String("weights_sha256", res.WeightsSHA256))
		return exitOK
	}
	if res.AlreadyFinished {
		fmt.Fprintf(stdout, "already finished at step %d (the run ends at step %d): nothing to train; %s\n",
			res.Steps, res.TotalSteps, lastEvaluation(j.cfg.MetricsPath(), res.Steps))
		if res.Checkpoint != "" {
			fmt.Fprintf(stdout, "checkpoint: %s\n", res.Checkpoint)
		}
		return exitOK
	}
	fmt.Fprintf(stdout, "done: %d steps (%.2f epochs), test accuracy %.4f, test loss %.4f\n", res.Steps, res.Epoch, res.TestAccuracy, res.TestLoss)
	j.log.Info("done", zap.Int64("steps", res.Steps), zap.String("weights_sha256", res.WeightsSHA256))
	if res.Checkpoint != "" {
		fmt.Fprintf(stdout, "checkpoint: %s\n", res.Checkpoint)
	}
	fmt.Fprintf(stdout, "metrics:    %s  (plot: qvd plot %s)\n", j.cfg.MetricsPath(), j.cfg.Run.Out)
	if tb := j.cfg.TensorBoard; tb.Enabled {
		fmt.Fprintf(stdout, "tensorboard: tensorboard --logdir %s\n", tb.Dir)
	}
	return exitOK
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

// resumeCommand is the command line that resumes a run started as prog with args: the same
// flags, shell-quoted, with --resume auto in place of any --resume.
func resumeCommand(prog string, args []string) string {
	words := []string{prog}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, _, inline := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "resume" {
			if !inline {
				i++ // its value
			}
			continue
		}
		if strings.HasPrefix(a, "-") && name == "overwrite" {
			continue // a bool flag: it moved the old run aside once, and refuses --resume
		}
		words = append(words, shellQuote(a))
	}
	return strings.Join(append(words, "--resume", "auto"), " ")
}

// shellQuote quotes s for a POSIX shell, leaving it bare when it has nothing to quote.
func shellQuote(s string) string {
	safe := func(r rune) bool {
		return r < utf8.RuneSelf && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
	}
	if s != "" && strings.IndexFunc(s, func(r rune) bool { return !safe(r) }) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// progName is how the user ran qvd, for commands printed back to them.
func progName() string {
	if filepath.Base(os.Args[0]) == "qvd" {
		return os.Args[0]
	}
	return "qvd"
}

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

// train builds this process's trainer from the job and runs it.
func (j *job) train(ctx context.Context) (trainer.Result, error) {
	cfg, log := j.cfg, j.log
	// Parameters, gradients, optimizer state and activations live outside the Go heap
	// (internal/arena), so the heap holds small objects only and a tight collection target
	// costs little CPU: GOGC 25 keeps the heap's resident memory within a quarter of what is
	// live, where the default lets it reach twice that. GOGC in the environment wins.
	if _, set := os.LookupEnv("GOGC"); !set {
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
	eng, err := newEngine(cfg, spec, layout, params, j.rank, log)
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
	build = mon.Measure("trainer build")
	t, err := trainer.New(setup)
	if err != nil {
		return trainer.Result{}, err
	}
	defer t.Close()
	if j.rank == 0 { // trainer.New has checked checkpoint.dir
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
	if j.member != nil {
		lost := t.Abort
		if sink.file != nil {
			lost = func(err error) {
				_ = sink.file.Write(memberLostRecord(err)) // after the run the file is closed: no event
				t.Abort(err)
			}
		}
		j.member.watchPeers(j.roster, lost)
	}
	res, err := t.Run(ctx)
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

type logger struct {
	log   *zap.Logger
	close func()
	err   func() error // the log file's first write error
}

// metricsBytesPerStep bounds what a step adds to the run directory, for the free-space check
// at the start: a train record in metrics.jsonl (about 650 bytes with the CPU engine's
// memory figures), an evaluation's share and train.log's periodic lines.
const metricsBytesPerStep = 1 << 10

// watchedFile is the log file, keeping its first write error: zap only prints such an
// error to stderr and carries on, where a run that cannot log must stop.
type watchedFile struct {
	f    *os.File
	path string
	mu   struct {
		sync.Mutex
		err error
	}
}

func (w *watchedFile) Write(p []byte) (int, error) {
	n, err := w.f.Write(p)
	if err != nil {
		w.mu.Lock()
		if w.mu.err == nil {
			w.mu.err = fmt.Errorf("writing log file %s: %w", w.path, err)
		}
		w.mu.Unlock()
	}
	return n, err
}

func (w *watchedFile) Sync() error { return w.f.Sync() }

func (w *watchedFile) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mu.err
}

// newLogger logs human-readable lines to w and, if path is not empty, JSON lines to path.
func newLogger(w io.Writer, path string, level zapcore.Level) (logger, error) {
	console := zap.NewDevelopmentEncoderConfig()
	console.EncodeTime = zapcore.TimeEncoderOfLayout("15:04:05")
	console.EncodeCaller = nil
	cores := []zapcore.Core{zapcore.NewCore(zapcore.NewConsoleEncoder(console), zapcore.AddSync(w), level)}
	var file *os.File
	var watched *watchedFile
	if path != "" {
		var err error
		if file, err = os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644); err != nil {
			return logger{}, fmt.Errorf("opening log file: %w", err)
		}
		watched = &watchedFile{f: file, path: path}
		jsonCfg := zap.NewProductionEncoderConfig()
		jsonCfg.EncodeTime = zapcore.ISO8601TimeEncoder
		cores = append(cores, zapcore.NewCore(zapcore.NewJSONEncoder(jsonCfg), watched, zapcore.DebugLevel))
	}
	log := zap.New(zapcore.NewTee(cores...))
	lg := logger{log: log, close: func() {
		_ = log.Sync()
		if file != nil {
			_ = file.Close()
		}
	}, err: func() error { return nil }}
	if watched != nil {
		lg.err = watched.Err
	}
	return lg, nil
}

// joinWithRetry joins through peer, retrying while the peer is not up yet (workers are often
// started before, or at the same time as, the coordinator), for up to patience. A refusal —
// wrong key, incompatible version, another TLS CA — is final.
func joinWithRetry(ctx context.Context, m *member, peer string, patience time.Duration, log *zap.Logger) error {
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
