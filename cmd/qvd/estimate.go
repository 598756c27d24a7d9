package main

import (
	"errors"
	"fmt"
	"io"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/job/estimate"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// cmdEstimate prints per-rank model-state memory for ZeRO stages 0-2 with and without
// offload, and recommends a micro-batch and accumulation for a memory budget (job/estimate).
func cmdEstimate(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("estimate")
	cfgName := fs.String("c", "", "take the parameter count, precision, optimizer and ZeRO settings from this config (a file or an embedded name)")
	params := fs.String("params", "", "parameter count Ψ, e.g. 1.3e9 or 350M (instead of -c)")
	world := fs.Int("world", 1, "ranks (GPUs or processes) N")
	stage := fs.Int("stage", -1, "ZeRO stage to mark in the table and use for --recommend (default: the config's, or 2)")
	offloadF := fs.String("offload", "", "none or cpu (default: the config's, or none)")
	precision := fs.String("precision", "", "fp32, fp16 or bf16 (default: the config's, or fp16)")
	optimizer := fs.String("optimizer", "", "adamw, adam, sgd, adamw8bit or adam8bit (default: the config's, or adamw)")
	accum := fs.Int("accum", 0, "micro-batches per step (default: the config's, or 1); at stage 1 without accumulation the gradient is partitioned as at stage 2")
	microF := fs.Int("micro-batch", 0, "micro-batch for the peak estimate (default: the config's)")
	maxSteps := fs.Int64("max-steps", 0, "steps the run takes, for the dataset pages it reads (default: the config's epochs and max_steps)")
	testSubset := fs.Int("test-subset", 0, "test samples the run evaluates (default: the config's)")
	recommend := fs.Bool("recommend", false, "recommend micro-batch and accumulation steps for --memory and --effective-batch")
	memory := fs.String("memory", "", "memory budget per rank for --recommend, e.g. 24GiB, 16GB, 512MiB")
	effective := fs.Int("effective-batch", 0, "global batch (micro × accum × world) to keep, for --recommend")
	actBytes := fs.String("activation-bytes", "", "activation memory per sample for --recommend, e.g. 1.5MiB (default: measured on the -c model)")
	exact := fs.Bool("bytes", false, "print sizes in bytes")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	fail := func(format string, a ...any) int {
		fmt.Fprintf(stderr, "qvd estimate: "+format+"\n", a...)
		return exitUsage
	}
	switch {
	case fs.NArg() > 0:
		return fail("unexpected argument %q", fs.Arg(0))
	case !*recommend && (*memory != "" || *effective != 0 || *actBytes != ""):
		return fail("--memory, --effective-batch and --activation-bytes go with --recommend")
	case (*cfgName == "") == (*params == ""):
		return fail("give exactly one of --params and -c")
	case *world < 1:
		return fail("--world must be >= 1, got %d", *world)
	}
	in := estimate.Input{World: *world, Stage: 2, Optimizer: optim.Config{Type: "adamw", Momentum: 0.9},
		Bucket: zero.DefaultConfig().ReduceBucketSize, Exact: *exact}
	prec := "fp16"
	var spec *model.Spec
	var cfg configs.Config
	if *cfgName != "" {
		var err error
		if cfg, err = configs.Load(*cfgName); err != nil {
			return fail("%v", err)
		}
		input, classes, err := job.DataShape(&cfg)
		if err != nil {
			return fail("%s: %v", *cfgName, err)
		}
		if spec, err = model.NewSpec(cfg.Model, input, classes); err != nil {
			return fail("%s: %v", *cfgName, err)
		}
		in.Elems, in.Stage, in.Offload, prec = model.NewLayout(spec).Size, cfg.Zero.Stage, cfg.Zero.Offload(), cfg.Train.Precision
		in.Optimizer, in.Bucket, in.Accum = cfg.Optimizer, cfg.Zero.ReduceBucketSize, cfg.Train.Accum
		in.Name = fmt.Sprintf("%s (%s)", *cfgName, spec)
	} else {
		n, err := estimate.ParseCount(*params)
		if err != nil {
			return fail("--params: %v", err)
		}
		in.Elems, in.Name = int(n), fmt.Sprintf("%s parameters", estimate.Human(n))
	}
	switch {
	case *stage != -1 && (*stage < 0 || *stage > 2):
		return fail("--stage must be 0, 1 or 2, got %d", *stage)
	case *stage != -1:
		in.Stage = *stage
	}
	switch *offloadF {
	case "":
	case "none", "cpu":
		in.Offload = *offloadF == "cpu"
	default:
		return fail("--offload must be none or cpu, got %q", *offloadF)
	}
	if *accum < 0 {
		return fail("--accum must be >= 1, got %d", *accum)
	}
	if *accum > 0 {
		in.Accum = *accum
	}
	if *precision != "" {
		prec = *precision
	}
	var err error
	if in.Format, err = half.ParseFormat(prec); err != nil {
		return fail("--precision: %v", err)
	}
	if *optimizer != "" {
		in.Optimizer.Type = *optimizer
	}
	if _, err := optim.StateElems(in.Optimizer); err != nil {
		return fail("--optimizer must be adamw, adam, sgd, adamw8bit or adam8bit, got %q", in.Optimizer.Type)
	}
	if err := in.WriteTable(stdout); err != nil {
		return fail("%v", err)
	}
	openCPU := func() (engine.Device, error) { return job.CPUDevice(nil, 0, 0) }
	if spec != nil && cfg.Engine == configs.EngineNative && !cfg.Device.GPU() {
		cfg.Train.Accum = max(in.Accum, 1)
		if *microF > 0 {
			cfg.Train.MicroBatch = *microF
		}
		if *maxSteps > 0 {
			cfg.Train.MaxSteps = *maxSteps
		}
		if *testSubset > 0 {
			cfg.Data.TestSubset = *testSubset
		}
		p, err := in.Peak(cfg, spec, openCPU)
		if err != nil {
			return fail("%v", err)
		}
		in.WritePeak(stdout, p)
	}
	if !*recommend {
		return exitOK
	}
	budget, err := estimate.ParseBytes(*memory)
	if err != nil || budget <= 0 {
		return fail("--recommend needs --memory (e.g. 24GiB): %v", errOr(err, "must be > 0"))
	}
	if *effective < 1 {
		return fail("--recommend needs --effective-batch >= 1")
	}
	var perSample int64
	source := "given"
	switch {
	case *actBytes != "":
		if perSample, err = estimate.ParseBytes(*actBytes); err != nil || perSample <= 0 {
			return fail("--activation-bytes: %v", errOr(err, "must be > 0"))
		}
	case spec != nil:
		if perSample, source, err = estimate.PerSample(spec, cfg.Engine, in.Format, openCPU); err != nil {
			return fail("measuring activation memory: %v", err)
		}
	default:
		return fail("--recommend needs -c CONFIG (to measure activation memory per sample) or --activation-bytes")
	}
	rec, err := in.Recommend(budget, int64(*effective), perSample)
	if err != nil {
		return fail("%v", err)
	}
	in.WriteRecommendation(stdout, rec, budget, int64(*effective), perSample, source)
	return exitOK
}

func errOr(err error, msg string) error {
	if err != nil {
		return err
	}
	return errors.New(msg)
}
