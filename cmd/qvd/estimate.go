package main

import (
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/offload"
	"github.com/qvd/qvd/zero"
)

// headroom is the share of a memory budget --recommend leaves free (fragmentation, the
// evaluation graph, the runtime, collective buffers): the memory guides' 20%.
const headroom = 0.20

// cmdEstimate prints per-rank model-state memory for ZeRO stages 0-2 with and without
// offload, in the form of DeepSpeed's estimate_zero2_model_states_mem_needs, and recommends a
// micro-batch and accumulation for a memory budget.
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
	if fs.NArg() > 0 {
		return fail("unexpected argument %q", fs.Arg(0))
	}
	exactBytes = *exact
	if !*recommend && (*memory != "" || *effective != 0 || *actBytes != "") {
		return fail("--memory, --effective-batch and --activation-bytes go with --recommend")
	}
	if (*cfgName == "") == (*params == "") {
		return fail("give exactly one of --params and -c")
	}
	if *world < 1 {
		return fail("--world must be >= 1, got %d", *world)
	}
	in := estimateInput{world: *world, stage: 2, offload: false, precision: "fp16", optimizer: "adamw", bucket: zero.DefaultConfig().ReduceBucketSize}
	var spec *model.Spec
	var cfg configs.Config
	if *cfgName != "" {
		var err error
		cfg, err = configs.Load(*cfgName)
		if err != nil {
			return fail("%v", err)
		}
		input, classes, err := dataShape(&cfg)
		if err != nil {
			return fail("%s: %v", *cfgName, err)
		}
		if spec, err = model.NewSpec(cfg.Model, input, classes); err != nil {
			return fail("%s: %v", *cfgName, err)
		}
		in.elems, in.numParams = model.NewLayout(spec).Size, model.NewLayout(spec).NumParams()
		in.stage, in.offload, in.precision, in.optimizer = cfg.Zero.Stage, cfg.Zero.Offload(), cfg.Train.Precision, cfg.Optimizer.Type
		in.bucket, in.momentum, in.accum = cfg.Zero.ReduceBucketSize, cfg.Optimizer.Momentum, cfg.Train.Accum
		in.name = fmt.Sprintf("%s (%s)", *cfgName, spec)
	} else {
		n, err := parseCount(*params)
		if err != nil {
			return fail("--params: %v", err)
		}
		in.elems, in.numParams, in.momentum = int(n), int(n), 0.9
		in.name = fmt.Sprintf("%s parameters", human(n))
	}
	if *stage != -1 {
		if *stage < 0 || *stage > 2 {
			return fail("--stage must be 0, 1 or 2, got %d", *stage)
		}
		in.stage = *stage
	}
	switch *offloadF {
	case "":
	case "none", "cpu":
		in.offload = *offloadF == "cpu"
	default:
		return fail("--offload must be none or cpu, got %q", *offloadF)
	}
	if *accum < 0 {
		return fail("--accum must be >= 1, got %d", *accum)
	}
	if *accum > 0 {
		in.accum = *accum
	}
	if *precision != "" {
		in.precision = *precision
	}
	if _, err := half.ParseFormat(in.precision); err != nil {
		return fail("--precision: %v", err)
	}
	if *optimizer != "" {
		in.optimizer = *optimizer
	}
	if in.stateElems() < 0 {
		return fail("--optimizer must be adamw, adam, sgd, adamw8bit or adam8bit, got %q", in.optimizer)
	}
	if err := in.printTable(stdout); err != nil {
		return fail("%v", err)
	}
	if spec != nil && cfg.Engine == configs.EngineNative && !cfg.Device.GPU() {
		cfg.Train.Accum = max(in.accum, 1)
		if *microF > 0 {
			cfg.Train.MicroBatch = *microF
		}
		if *maxSteps > 0 {
			cfg.Train.MaxSteps = *maxSteps
		}
		if *testSubset > 0 {
			cfg.Data.TestSubset = *testSubset
		}
		p, err := estimatePeak(cfg, in, spec)
		if err != nil {
			return fail("%v", err)
		}
		p.print(stdout, in)
	}
	if !*recommend {
		return exitOK
	}
	budget, err := parseBytes(*memory)
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
		if perSample, err = parseBytes(*actBytes); err != nil || perSample <= 0 {
			return fail("--activation-bytes: %v", errOr(err, "must be > 0"))
		}
	case spec != nil && cfg.Engine == configs.EngineNative:
		// The native engine's allocator at two micro-batches (evaluation batch 1).
		var a, b int64
		if a, err = measurePeakActivations(spec, in.format(), 8, 1); err == nil {
			b, err = measurePeakActivations(spec, in.format(), 40, 1)
		}
		if err != nil {
			return fail("measuring activation memory: %v", err)
		}
		perSample, source = (b-a)/32, "measured on the native engine"
	case spec != nil:
		if perSample, err = measureActivationBytes(spec, in.format()); err != nil {
			return fail("measuring activation memory: %v", err)
		}
		source = "measured on the gorgonia engine"
	default:
		return fail("--recommend needs -c CONFIG (to measure activation memory per sample) or --activation-bytes")
	}
	rec, err := in.recommend(budget, int64(*effective), perSample)
	if err != nil {
		return fail("%v", err)
	}
	fmt.Fprintf(stdout, "\nRecommendation for %s per rank, effective batch %d, %d rank(s), stage %d%s:\n",
		humanBytes(budget), *effective, in.world, in.stage, map[bool]string{true: " + offload", false: ""}[in.offload])
	fmt.Fprintf(stdout, "  activations: %s per sample (%s)\n", humanBytes(perSample), source)
	fmt.Fprintf(stdout, "  model states (qvd CPU engine): %s; usable after %.0f%% headroom: %s; room for %d samples per micro-batch\n",
		humanBytes(rec.states), headroom*100, humanBytes(rec.usable), rec.maxMicro)
	fmt.Fprintf(stdout, "  micro_batch: %d\n  accum: %d\n  (%d × %d × %d = %d; peak ≈ %s)\n",
		rec.micro, rec.accum, rec.micro, rec.accum, in.world, *effective, humanBytes(rec.states+int64(rec.micro)*perSample))
	fmt.Fprintf(stdout, "  qvd train -c CONFIG --micro-batch %d --accum %d\n", rec.micro, rec.accum)
	return exitOK
}

func errOr(err error, msg string) error {
	if err != nil {
		return err
	}
	return errors.New(msg)
}

type estimateInput struct {
	name                 string
	elems, numParams     int
	world, stage         int
	offload              bool
	precision, optimizer string
	momentum             float64
	bucket               int64
	accum                int
}

func (in estimateInput) format() half.Format { f, _ := half.ParseFormat(in.precision); return f }

// stateElems is the optimizer state per parameter (-1: unknown optimizer).
func (in estimateInput) stateElems() int {
	switch in.optimizer {
	case "adam", "adamw", "adam8bit", "adamw8bit":
		return 2
	case "sgd":
		if in.momentum != 0 {
			return 1
		}
		return 0
	}
	return -1
}

// quantized says the optimizer keeps its state in 8 bits (offload.QuantizedStateBytes).
func (in estimateInput) quantized() bool {
	return in.optimizer == offload.TypeAdam8bit || in.optimizer == offload.TypeAdamW8bit
}

func (in estimateInput) spec(stage int, offload bool, elemBytes int) zero.Spec {
	return zero.Spec{Elems: in.elems, World: in.world, Stage: stage, Offload: offload, ElemBytes: elemBytes,
		FP32: in.format() == half.FP32, StateElems: in.stateElems(), Quantized: in.quantized(), BucketElems: in.bucketElems(), Accum: in.accum}
}

// bucketElems is the reduce bucket the engine will use: the config's, or the one it sizes
// from the model and the world (zero_optimization.reduce_bucket_size 0).
func (in estimateInput) bucketElems() int {
	if in.bucket > 0 {
		return int(min(in.bucket, int64(max(in.elems, 1))))
	}
	return zero.AutoBucketElems(in.elems, in.world)
}

// printTable prints both accountings for every stage and offload setting.
func (in estimateInput) printTable(w io.Writer) error {
	f := in.format()
	fmt.Fprintf(w, "Estimated memory for model states (parameters, gradients, master weights, optimizer state) per rank:\n")
	fmt.Fprintf(w, "HW: %d rank(s).  SW: %s, Ψ = %d elements, %s, %s.\n\n", in.world, in.name, in.elems, f, in.optimizer)
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "\tper device\tper host\tqvd CPU engine\t  options\t  ZeRO formula (%d-byte elements)\t\n", f.Bytes())
	for stage := 0; stage <= 2; stage++ {
		for _, off := range []bool{false, true} {
			gpu, err := zero.Estimate(in.spec(stage, off, f.Bytes()))
			if err != nil {
				return err
			}
			cpu, err := zero.Estimate(in.spec(stage, off, 4))
			if err != nil {
				return err
			}
			mark := " "
			if stage == in.stage && off == in.offload {
				mark = "*"
			}
			offS := "none"
			if off {
				offS = "cpu"
			}
			fs := stage
			if zero.GradPartitioned(stage, in.accum) {
				fs = 2 // stage 1 without accumulation holds what stage 2 does
			}
			formula := zero.PaperFormula(fs, off)
			if f == half.FP32 || in.stateElems() != 2 || in.quantized() {
				formula = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t  stage=%d offload_optimizer=%s\t  %s\t\n", mark, humanBytes(gpu.Device.Total()), humanBytes(gpu.Host.Total()),
				humanBytes(cpu.Total()), stage, offS, formula)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nper device / per host: a GPU engine storing %s in %d bytes (the staging buckets included);\n"+
		"qvd CPU engine: what `qvd train` allocates on this machine (every format stored as float32, device and host\n"+
		"being the same RAM), on the rank with the largest shard. * marks stage %d, offload %v. Activations are extra.\n",
		f, f.Bytes(), in.stage, in.offload)
	return nil
}

type recommendation struct {
	states, usable int64
	maxMicro       int64
	micro, accum   int64
}

// recommend picks the largest micro-batch that fits the budget less the headroom and the
// model states and divides the per-rank batch, so the effective batch is kept exactly.
func (in estimateInput) recommend(budget, effective, perSample int64) (recommendation, error) {
	var r recommendation
	if effective%int64(in.world) != 0 {
		return r, fmt.Errorf("the effective batch %d is not a multiple of the world size %d", effective, in.world)
	}
	m, err := zero.Estimate(in.spec(in.stage, in.offload, 4))
	if err != nil {
		return r, err
	}
	r.states = m.Total()
	r.usable = int64(float64(budget) * (1 - headroom))
	if r.usable <= r.states {
		return r, fmt.Errorf("the model states alone need %s, more than the %s usable of the %s budget; try a higher stage, offload or more ranks",
			humanBytes(r.states), humanBytes(r.usable), humanBytes(budget))
	}
	r.maxMicro = (r.usable - r.states) / perSample
	if r.maxMicro < 1 {
		return r, fmt.Errorf("one sample's activations (%s) do not fit in the %s left after the model states", humanBytes(perSample), humanBytes(r.usable-r.states))
	}
	perRank := effective / int64(in.world)
	for d := min(perRank, r.maxMicro); d >= 1; d-- {
		if perRank%d == 0 {
			r.micro, r.accum = d, perRank/d
			break
		}
	}
	return r, nil
}

// measureActivationBytes measures the heap a training graph holds per sample: the graph is
// built and run at two micro-batch sizes and the difference divided by the difference in
// samples, so what does not grow with the batch (weights, gradients, graph structure) cancels.
func measureActivationBytes(spec *model.Spec, f half.Format) (int64, error) {
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	model.Init(spec, layout, params, 1)
	grads := make([]float32, layout.Size)
	at := func(micro int) (int64, error) {
		before := heapInUse()
		after, err := heapAfterStep(spec, layout, params, grads, f, micro)
		return after - before, err
	}
	const small, large = 8, 72
	if _, err := at(small); err != nil { // one-time allocations (gorgonia's caches) land here
		return 0, err
	}
	a, err := at(small)
	if err != nil {
		return 0, err
	}
	b, err := at(large)
	if err != nil {
		return 0, err
	}
	per := (b - a) / (large - small)
	if per <= 0 {
		return 0, fmt.Errorf("no growth with the batch (%d bytes at %d samples, %d at %d); give --activation-bytes", a, small, b, large)
	}
	return per, nil
}

// parseCount parses 1.3e9, 350M, 7B, 125000.
func parseCount(s string) (float64, error) {
	s = strings.TrimSpace(s)
	mul := 1.0
	if n := len(s); n > 0 {
		switch s[n-1] {
		case 'K', 'k':
			mul, s = 1e3, s[:n-1]
		case 'M', 'm':
			mul, s = 1e6, s[:n-1]
		case 'B', 'b', 'G', 'g':
			mul, s = 1e9, s[:n-1]
		case 'T', 't':
			mul, s = 1e12, s[:n-1]
		}
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(v) || v*mul < 1 || v*mul > 1e15 {
		return 0, fmt.Errorf("%q is not a parameter count between 1 and 1e15", s)
	}
	return math.Round(v * mul), nil
}

// parseBytes parses 24GiB, 16GB, 512MiB, 1.5MiB, 1048576 (memory.ParseBytes).
func parseBytes(s string) (int64, error) {
	b, err := memory.ParseBytes(s)
	return int64(b), err
}

// exactBytes makes humanBytes print plain byte counts (qvd estimate --bytes).
var exactBytes bool

func humanBytes(b int64) string {
	switch {
	case exactBytes:
		return strconv.FormatInt(b, 10)
	case b < 0:
		return "-" + memstat.FormatBytes(uint64(-b))
	}
	return memstat.FormatBytes(uint64(b))
}

func human(n float64) string {
	switch {
	case n >= 1e9:
		return fmt.Sprintf("%.2fB", n/1e9)
	case n >= 1e6:
		return fmt.Sprintf("%.1fM", n/1e6)
	}
	return strconv.FormatFloat(n, 'f', -1, 64)
}
