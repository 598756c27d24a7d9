package estimate

import (
	"errors"
	"fmt"
	"io"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// Request is one `qvd estimate`: the model comes from Config or from Params, and the other
// fields override the config's settings where given (zero values: the config's, or the
// defaults a bare parameter count assumes). Its errors name the flags.
type Request struct {
	Config     string // a config file or embedded name (-c)
	Params     string // a parameter count, e.g. 1.3e9 or 350M (--params), instead of Config
	World      int    // ranks N
	Stage      int    // the ZeRO stage to mark and recommend for; -1: the config's, or 2
	Offload    string // "", none or cpu
	Precision  string // "", fp32, fp16 or bf16 (a parameter count's default: fp16)
	Optimizer  string // "", or an optimizer type (a parameter count's default: adamw)
	Accum      int    // 0: the config's, or 1
	MicroBatch int    // 0: the config's; for the peak estimate
	MaxSteps   int64  // 0: the config's; the run's length, for the dataset pages it reads
	TestSubset int    // 0: the config's
	// Recommend asks for a micro-batch and accumulation for Memory (a byte size, e.g. 24GiB)
	// and EffectiveBatch, with ActivationBytes per sample ("": measured on the config's model).
	Recommend       bool
	Memory          string
	EffectiveBatch  int
	ActivationBytes string
	Exact           bool // sizes in bytes
}

// ShapeFunc is the model's input shape and classes for a config (job.DataShape, which this
// package may not import).
type ShapeFunc func(cfg *configs.Config) (input []int, classes int, err error)

// Run writes the estimate of r to w: the model-state table; for a config of the native CPU
// engine, the peak resident memory of a rank; with Recommend, the recommendation. Devices for
// measuring come from open; the model's shape from shape.
func (r Request) Run(w io.Writer, shape ShapeFunc, open OpenDevice) error {
	switch {
	case !r.Recommend && (r.Memory != "" || r.EffectiveBatch != 0 || r.ActivationBytes != ""):
		return errors.New("--memory, --effective-batch and --activation-bytes go with --recommend")
	case (r.Config == "") == (r.Params == ""):
		return errors.New("give exactly one of --params and -c")
	case r.World < 1:
		return fmt.Errorf("--world must be >= 1, got %d", r.World)
	}
	in := Input{World: r.World, Stage: 2, Optimizer: optim.Config{Type: "adamw", Momentum: 0.9},
		Bucket: zero.DefaultConfig().ReduceBucketSize, Exact: r.Exact}
	prec := "fp16"
	var spec *model.Spec
	var cfg configs.Config
	if r.Config != "" {
		var err error
		if cfg, err = configs.Load(r.Config); err != nil {
			return err
		}
		input, classes, err := shape(&cfg)
		if err != nil {
			return fmt.Errorf("%s: %v", r.Config, err)
		}
		if spec, err = model.NewSpec(cfg.Model, input, classes); err != nil {
			return fmt.Errorf("%s: %v", r.Config, err)
		}
		in.Elems, in.Stage, in.Offload, prec = model.NewLayout(spec).Size, cfg.Zero.Stage, cfg.Zero.Offload(), cfg.Train.Precision
		in.Optimizer, in.Bucket, in.Accum = cfg.Optimizer, cfg.Zero.ReduceBucketSize, cfg.Train.Accum
		in.Name = fmt.Sprintf("%s (%s)", r.Config, spec)
	} else {
		n, err := ParseCount(r.Params)
		if err != nil {
			return fmt.Errorf("--params: %v", err)
		}
		in.Elems, in.Name = int(n), fmt.Sprintf("%s parameters", Human(n))
	}
	if err := r.override(&in, &prec); err != nil {
		return err
	}
	if err := in.WriteTable(w); err != nil {
		return err
	}
	if spec != nil && cfg.Engine == configs.EngineNative && !cfg.Device.GPU() {
		cfg.Train.Accum = max(in.Accum, 1)
		if r.MicroBatch > 0 {
			cfg.Train.MicroBatch = r.MicroBatch
		}
		if r.MaxSteps > 0 {
			cfg.Train.MaxSteps = r.MaxSteps
		}
		if r.TestSubset > 0 {
			cfg.Data.TestSubset = r.TestSubset
		}
		p, err := in.Peak(cfg, spec, open)
		if err != nil {
			return err
		}
		in.WritePeak(w, p)
	}
	if !r.Recommend {
		return nil
	}
	return r.recommend(w, in, spec, cfg.Engine, open)
}

// override applies r's settings over the config's (or the parameter count's defaults).
func (r Request) override(in *Input, prec *string) error {
	switch {
	case r.Stage != -1 && (r.Stage < 0 || r.Stage > 2):
		return fmt.Errorf("--stage must be 0, 1 or 2, got %d", r.Stage)
	case r.Stage != -1:
		in.Stage = r.Stage
	}
	switch r.Offload {
	case "":
	case "none", "cpu":
		in.Offload = r.Offload == "cpu"
	default:
		return fmt.Errorf("--offload must be none or cpu, got %q", r.Offload)
	}
	if r.Accum < 0 {
		return fmt.Errorf("--accum must be >= 1, got %d", r.Accum)
	}
	if r.Accum > 0 {
		in.Accum = r.Accum
	}
	if r.Precision != "" {
		*prec = r.Precision
	}
	var err error
	if in.Format, err = half.ParseFormat(*prec); err != nil {
		return fmt.Errorf("--precision: %v", err)
	}
	if r.Optimizer != "" {
		in.Optimizer.Type = r.Optimizer
	}
	if _, err := optim.StateElems(in.Optimizer); err != nil {
		return fmt.Errorf("--optimizer must be adamw, adam, sgd, adamw8bit or adam8bit, got %q", in.Optimizer.Type)
	}
	return nil
}

// recommend writes the micro-batch and accumulation for r's budget and effective batch.
func (r Request) recommend(w io.Writer, in Input, spec *model.Spec, engineName string, open OpenDevice) error {
	budget, err := ParseBytes(r.Memory)
	if err != nil || budget <= 0 {
		return fmt.Errorf("--recommend needs --memory (e.g. 24GiB): %v", errOr(err, "must be > 0"))
	}
	if r.EffectiveBatch < 1 {
		return errors.New("--recommend needs --effective-batch >= 1")
	}
	var perSample int64
	source := "given"
	switch {
	case r.ActivationBytes != "":
		if perSample, err = ParseBytes(r.ActivationBytes); err != nil || perSample <= 0 {
			return fmt.Errorf("--activation-bytes: %v", errOr(err, "must be > 0"))
		}
	case spec != nil:
		if perSample, source, err = PerSample(spec, engineName, in.Format, open); err != nil {
			return fmt.Errorf("measuring activation memory: %v", err)
		}
	default:
		return errors.New("--recommend needs -c CONFIG (to measure activation memory per sample) or --activation-bytes")
	}
	rec, err := in.Recommend(budget, int64(r.EffectiveBatch), perSample)
	if err != nil {
		return err
	}
	in.WriteRecommendation(w, rec, budget, int64(r.EffectiveBatch), perSample, source)
	return nil
}

func errOr(err error, msg string) error {
	if err != nil {
		return err
	}
	return errors.New(msg)
}
