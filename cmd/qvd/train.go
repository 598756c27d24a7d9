package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"go.uber.org/zap/zapcore"
	"go.yaml.in/yaml/v3"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/elastic"
	"github.com/qvd/qvd/internal/cli"
	"github.com/qvd/qvd/internal/promexport"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
	"github.com/qvd/qvd/rundir"
	"github.com/qvd/qvd/trainer"
)

// runFlags are the flags shared by `train` and `config`: where the config comes from and the
// fields a flag may override (configs.Overrides: flags win over the DeepSpeed JSON, which
// wins over the YAML).
type runFlags struct {
	fs                *flag.FlagSet
	config, deepspeed string
	o                 configs.Overrides
}

func newRunFlags(name string) *runFlags {
	f := &runFlags{fs: newFlagSet(name)}
	fs, o := f.fs, &f.o
	fs.StringVar(&f.config, "c", "", "config: a YAML file, or the name of an embedded config ("+fmt.Sprint(configs.Embedded())+"); default "+configs.DefaultName)
	fs.StringVar(&f.config, "config", "", "same as -c")
	fs.StringVar(&f.deepspeed, "deepspeed", "", "a DeepSpeed ds_config.json applied over the config")
	fs.Var(microBatchFlag{&o.MicroBatch}, "micro-batch", "samples per forward/backward, or auto: the largest that fits the memory budget (train.micro_batch)")
	cli.Optional(fs, &o.EffectiveBatch, "effective-batch", "global batch micro-batch auto keeps: micro × accum × world (train.effective_batch)")
	cli.Optional(fs, &o.Accum, "accum", "micro-batches per optimizer step (train.accum)")
	cli.Optional(fs, &o.Precision, "precision", "fp32, fp16 or bf16 (train.precision)")
	cli.Optional(fs, &o.Epochs, "epochs", "epochs to train (train.epochs)")
	cli.Optional(fs, &o.LR, "lr", "base learning rate (optimizer.lr)")
	cli.Optional(fs, &o.Out, "out", "run directory for metrics, logs and checkpoints (run.out)")
	cli.Optional(fs, &o.Seed, "seed", "random seed for initialisation and data order (run.seed)")
	cli.Optional(fs, &o.MaxSteps, "max-steps", "stop after this many optimizer steps (train.max_steps)")
	cli.Optional(fs, &o.Threads, "threads", "threads for BLAS and the optimizer (train.threads; 0 = all cores)")
	cli.Optional(fs, &o.TrainSubset, "train-subset", "train on the first N samples only (data.train_subset)")
	cli.Optional(fs, &o.TestSubset, "test-subset", "evaluate on the first N test samples only (data.test_subset)")
	cli.Optional(fs, &o.DataPath, "data", "dataset directory (data.path)")
	cli.Optional(fs, &o.Transport, "transport", "data path between processes: auto (shared memory within a host, TCP across), shm, tcp, grpc or nccl (collective.transport)")
	cli.Optional(fs, &o.Device, "device", "where the engine runs: cpu, cuda (a qvd built with -tags cuda) or reference (the plain-Go reference device) (device.type)")
	cli.Optional(fs, &o.Engine, "engine", "native (qvd's layer engine) or gorgonia (the gorgonia graphs, CPU only) (engine)")
	cli.Optional(fs, &o.ZeroStage, "zero-stage", "ZeRO stage 0, 1 or 2 (zero_optimization.stage)")
	cli.Optional(fs, &o.Offload, "offload", "optimizer state and step in host memory: none or cpu (zero_optimization.offload_optimizer.device)")
	cli.Optional(fs, &o.CheckpointEvery, "checkpoint-every", "write a checkpoint every N steps (checkpoint.every_steps; 0 = only at the end and on Ctrl-C)")
	cli.Optional(fs, &o.Recompute, "activation-checkpointing", "recompute activations in this many segments to save memory; 0 or 1 = off (model.activation_checkpointing.segments)")
	cli.Optional(fs, &o.MetricsAddr, "metrics-addr", "serve Prometheus metrics on HOST:PORT/metrics; rank r of a job uses PORT+r, PORT 0 a free port each (monitoring.metrics_addr)")
	cli.Optional(fs, &o.DashboardAddr, "dashboard-addr", "serve the live dashboard (as qvd dashboard does) on HOST:PORT while training, from rank 0; PORT 0 a free port (dashboard.addr)")
	return f
}

// resolveWorld builds the run's configuration (configs.Overrides.Load), then job.Resolve's
// derived values (micro_batch: auto) and validation, for a job of world processes.
func (f *runFlags) resolveWorld(world int) (configs.Config, []string, error) {
	cfg, ds, err := f.o.Load(f.config, f.deepspeed)
	if err != nil {
		return cfg, nil, err
	}
	warns, err := job.Resolve(&cfg, ds, world, job.AutoOptions{LocalRank: job.LocalRank(os.Getenv, 0)})
	return cfg, warns, err
}

func cmdConfig(args []string, stdout, stderr io.Writer) int {
	f := newRunFlags("config")
	if code, ok := parseFlags(f.fs, args, stdout, stderr); !ok {
		return code
	}
	cfg, warns, err := f.resolveWorld(1)
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
	f := newRunFlags("train")
	var o outputFlags
	o.register(f.fs)
	var resume string
	var mf memberFlags
	f.fs.StringVar(&resume, "resume", "", `continue from a checkpoint directory, or "auto" for the newest valid one in checkpoint.dir (none: start fresh)`)
	var overwrite bool
	f.fs.BoolVar(&overwrite, "overwrite", false, "start a new run in a run directory that holds another run: its contents move to <out>.old-<time> (nothing is deleted)")
	nodes := elastic.Nodes{World: 1}
	f.fs.Var(&nodes, "nodes", "number of processes in the job: N > 1 makes this the coordinating member, which waits for N-1 workers to run qvd join; MIN:MAX (torchrun's convention) starts with MAX and keeps training down to MIN members (elastic.min_nodes, elastic.max_nodes)")
	mf.register(f.fs)
	if code, ok := parseFlags(f.fs, args, stdout, stderr); !ok {
		return code
	}
	if f.fs.NArg() > 0 {
		fmt.Fprintf(stderr, "qvd train: unexpected argument %q (flags only)\n", f.fs.Arg(0))
		return exitUsage
	}
	if code, handled := envTrain(ctx, f, &nodes.World, &mf, o, stdout, stderr); handled {
		return code
	}
	if nodes.World < 1 || nodes.World > 65535 {
		fmt.Fprintf(stderr, "qvd train: --nodes must be in [1, 65535], got %d\n", nodes.World)
		return exitUsage
	}
	cfg, warns, err := f.resolveWorld(nodes.World)
	if err != nil {
		fmt.Fprintf(stderr, "qvd train: %v\n", err)
		return exitUsage
	}
	nodes.Apply(&cfg.Elastic)
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
	opts, ok := o.options(stdout, stderr)
	if !ok {
		return exitUsage
	}
	opts.Resume, opts.Warnings, opts.RunDir = resume, warns, rd
	if os.Getenv(launch.LaunchedEnv) == "" { // under qvd launch, the launcher prints the hint
		opts.ResumeHint = launch.ResumeCommand(progName()+" train", args)
	}
	if nodes.World > 1 {
		opts.Coordinator = &job.Coordinator{Nodes: nodes.World, Member: mf.options()}
	}
	res, err := job.Run(ctx, cfg, opts)
	return jobExit(stderr, res, err)
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
	boot, err := job.NewLogger(stderr, "", zapcore.InfoLevel)
	if err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		return exitFailure
	}
	m, err := job.StartMember(configs.Default().Cluster, cluster.TLSConfig{}, cluster.RoleWorker, "", mf.options(), boot.Log)
	if err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		return exitUsage
	}
	defer m.Close()
	roster, cfg, err := job.AwaitJob(ctx, m, peer, dataPath, boot.Log)
	if err != nil {
		fmt.Fprintf(stderr, "qvd join: %v\n", err)
		if errors.Is(err, configs.ErrInvalid) {
			return exitUsage
		}
		return exitFailure
	}
	opts, ok := o.options(stdout, stderr)
	if !ok {
		return exitUsage
	}
	opts.Worker = &job.Worker{Member: m, Roster: roster}
	res, err := job.Run(ctx, cfg, opts)
	return jobExit(stderr, res, err)
}

// jobExit maps job.Run's outcome to the exit code, printing a failure as "qvd: ...".
func jobExit(stderr io.Writer, res trainer.Result, err error) int {
	switch {
	case err == nil:
		return exitOK
	case res.Interrupted:
		return exitInterrupted // job.Run printed where it stopped
	}
	fmt.Fprintf(stderr, "qvd: %v\n", err)
	if errors.Is(err, configs.ErrInvalid) {
		return exitUsage
	}
	return exitFailure
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

// options are the job.Options these flags give, with the process's streams and environment;
// false after reporting a bad --log-level.
func (o outputFlags) options(stdout, stderr io.Writer) (job.Options, bool) {
	var level zapcore.Level
	if err := level.Set(o.logLevel); err != nil {
		fmt.Fprintf(stderr, "qvd: --log-level: %v\n", err)
		return job.Options{}, false
	}
	return job.Options{Stdout: stdout, Stderr: stderr, LogLevel: level, Quiet: o.quiet, MetricsAddr: o.metricsAddr, LookupEnv: os.LookupEnv}, true
}

// progName is how the user ran qvd, for commands printed back to them.
func progName() string {
	if filepath.Base(os.Args[0]) == "qvd" {
		return os.Args[0]
	}
	return "qvd"
}
