package configs

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/trainer"
)

// DeepSpeed keys that only change DeepSpeed's own logging or kernels, not the training
// computation: accepted with a warning so that existing ds_config.json files load.
var dsIgnored = map[string]string{
	"steps_per_print":               "qvd's progress line and metrics file replace it",
	"wall_clock_breakdown":          "use the metrics file's samples_per_sec",
	"dump_state":                    "not applicable",
	"wandb":                         "qvd writes metrics.jsonl instead",
	"comms_logger":                  "not applicable",
	"flops_profiler":                "not applicable",
	"zero_allow_untested_optimizer": "every qvd optimizer works with every stage",
	"prescale_gradients":            "qvd averages in fp32 after the reduction, which is what prescaling protects",
	"memory_breakdown":              "not applicable",
}

// zero_optimization keys that tune DeepSpeed's CUDA-side implementation and have no meaning
// (or are always on) in qvd.
var dsZeroIgnored = map[string]bool{
	"contiguous_gradients": true, "reduce_scatter": true, "allgather_partitions": true,
	"round_robin_gradients": true, "load_from_fp32_weights": true, "elastic_checkpoint": true,
}

// DeepSpeedResult reports what the mapping did besides changing the config.
type DeepSpeedResult struct {
	Warnings []string // keys accepted without effect
	// TrainBatchSize is train_batch_size if the file set it (checked by CheckBatch once the
	// world size is known), else 0.
	TrainBatchSize int
	// MicroSet and AccumSet record whether the micro-batch and accumulation were given
	// explicitly (by the file, or by a flag: the caller sets them then).
	MicroSet, AccumSet bool
}

// LoadDeepSpeed reads a ds_config.json and applies it to c.
func LoadDeepSpeed(c *Config, path string) (DeepSpeedResult, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return DeepSpeedResult{}, fmt.Errorf("deepspeed config: %w", err)
	}
	res, err := ApplyDeepSpeed(c, b)
	if err != nil {
		return res, fmt.Errorf("%w: deepspeed config %s: %w", ErrInvalid, path, err)
	}
	return res, nil
}

// ApplyDeepSpeed maps DeepSpeed's config keys onto c. A key qvd does not support is an
// error naming it; a key that only tunes DeepSpeed itself is a warning.
func ApplyDeepSpeed(c *Config, text []byte) (DeepSpeedResult, error) {
	var res DeepSpeedResult
	top, err := object(text, "top level")
	if err != nil {
		return res, err
	}
	// encoding/json keeps the last of two equal keys without a word; the YAML loader refuses
	// duplicates, and so does this.
	if err := duplicateKeys(text); err != nil {
		return res, err
	}
	var micro, accum, total int
	for _, key := range sortedKeys(top) {
		raw := top[key]
		switch key {
		case "train_micro_batch_size_per_gpu":
			err = intOrAuto(raw, key, &micro)
		case "gradient_accumulation_steps":
			err = intOrAuto(raw, key, &accum)
		case "train_batch_size":
			err = intOrAuto(raw, key, &total)
		case "gradient_clipping":
			err = number(raw, key, &c.Train.MaxGradNorm)
		case "fp16":
			err = dsFP16(c, raw)
		case "bf16", "bfloat16":
			var on bool
			if on, err = enabled(raw, key, nil); err == nil && on {
				if c.Train.Precision == "fp16" {
					err = fmt.Errorf("%s.enabled: fp16 and bf16 cannot both be enabled", key)
				} else {
					c.Train.Precision = "bf16"
				}
			}
		case "optimizer":
			err = dsOptimizer(c, raw)
		case "scheduler":
			err = dsScheduler(c, raw)
		case "tensorboard", "csv_monitor":
			err = dsMonitor(c, raw, key)
		case "zero_optimization":
			var warns []string
			warns, err = dsZero(c, raw)
			res.Warnings = append(res.Warnings, warns...)
		default:
			if why, ok := dsIgnored[key]; ok {
				res.Warnings = append(res.Warnings, fmt.Sprintf("deepspeed key %q has no effect in qvd: %s", key, why))
				continue
			}
			err = fmt.Errorf("%s: not supported by qvd (supported: train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, gradient_clipping, fp16, bf16, optimizer, scheduler, zero_optimization, tensorboard, csv_monitor)", key)
		}
		if err != nil {
			return res, err
		}
	}
	if micro > 0 {
		c.Train.MicroBatch, res.MicroSet = micro, true
	}
	if accum > 0 {
		c.Train.Accum, res.AccumSet = accum, true
	}
	res.TrainBatchSize = total
	return res, nil
}

// dsJobName is the job_name of DeepSpeed's TensorBoardConfig and CSVConfig when none is given.
const dsJobName = "DeepSpeedJobName"

// dsMonitor maps DeepSpeed's tensorboard or csv_monitor section ({enabled, output_path,
// job_name}) onto the run's monitor of the same kind. As in DeepSpeed, the files go to
// os.path.join(output_path, job_name) (output_path "" means the working directory), and a
// section without enabled: true turns the monitor off.
func dsMonitor(c *Config, raw json.RawMessage, key string) error {
	obj, err := object(raw, key)
	if err != nil {
		return err
	}
	on, err := enabled(raw, key, obj)
	if err != nil {
		return err
	}
	out, job := "", dsJobName
	for _, k := range sortedKeys(obj) {
		switch k {
		case "enabled":
		case "output_path":
			err = json.Unmarshal(obj[k], &out)
		case "job_name":
			err = json.Unmarshal(obj[k], &job)
		default:
			return fmt.Errorf("%s.%s: not supported by qvd (supported: enabled, output_path, job_name)", key, k)
		}
		if err != nil {
			return fmt.Errorf("%s.%s: want a string: %v", key, k, err)
		}
	}
	dst := &c.TensorBoard
	if key == "csv_monitor" {
		dst = &c.CSVMonitor
	}
	dst.Enabled = on
	if on {
		// Python's os.path.join: an absolute job_name replaces output_path.
		if filepath.IsAbs(job) {
			out = ""
		}
		dst.Dir = filepath.Join(out, job)
	}
	return nil
}

// CheckBatch derives the batch figure DeepSpeed would derive when train_batch_size is given
// without micro-batch or accumulation (only train_batch_size: accum 1), then checks
// train_batch_size = micro × accum × world, with an error naming all three. Call it after
// command-line flags are applied (set MicroSet/AccumSet if a flag gave the value).
func (r DeepSpeedResult) CheckBatch(c *Config, world int) error {
	total := r.TrainBatchSize
	if total == 0 {
		return nil
	}
	derive := func(name string, div int, dst *int) error {
		if div < 1 || total%div != 0 {
			return fmt.Errorf("%w: train_batch_size %d is not divisible by %s", ErrInvalid, total, name)
		}
		*dst = total / div
		return nil
	}
	var err error
	switch {
	case !r.MicroSet && !r.AccumSet:
		c.Train.Accum = 1
		err = derive(fmt.Sprintf("the world size %d", world), world, &c.Train.MicroBatch)
	case r.MicroSet && !r.AccumSet:
		err = derive(fmt.Sprintf("train_micro_batch_size_per_gpu %d × world size %d", c.Train.MicroBatch, world), c.Train.MicroBatch*world, &c.Train.Accum)
	case !r.MicroSet && r.AccumSet:
		err = derive(fmt.Sprintf("gradient_accumulation_steps %d × world size %d", c.Train.Accum, world), c.Train.Accum*world, &c.Train.MicroBatch)
	}
	if err != nil {
		return err
	}
	if m, a := c.Train.MicroBatch, c.Train.Accum; m*a*world != total {
		return fmt.Errorf("%w: train_batch_size %d must equal train_micro_batch_size_per_gpu %d × gradient_accumulation_steps %d × world size %d = %d",
			ErrInvalid, total, m, a, world, m*a*world)
	}
	return nil
}

func dsFP16(c *Config, raw json.RawMessage) error {
	obj, err := object(raw, "fp16")
	if err != nil {
		return err
	}
	on, err := enabled(raw, "fp16", obj)
	if err != nil {
		return err
	}
	for _, k := range sortedKeys(obj) {
		v := obj[k]
		var err error
		switch k {
		case "enabled":
		case "loss_scale":
			err = number(v, "fp16."+k, &c.FP16.LossScale)
		case "initial_scale_power":
			err = integer(v, "fp16."+k, &c.FP16.InitialScalePower)
		case "loss_scale_window":
			err = integer(v, "fp16."+k, &c.FP16.Window)
		case "hysteresis":
			err = integer(v, "fp16."+k, &c.FP16.Hysteresis)
		case "consecutive_hysteresis":
			err = json.Unmarshal(v, &c.FP16.ConsecutiveHysteresis)
		case "min_loss_scale":
			err = number(v, "fp16."+k, &c.FP16.MinScale)
		case "auto_cast":
			var b bool
			if err = json.Unmarshal(v, &b); err == nil && b {
				err = fmt.Errorf("fp16.auto_cast: true is not supported (qvd rounds the whole model to fp16)")
			}
		case "fp16_master_weights_and_grads":
			var b bool
			if err = json.Unmarshal(v, &b); err == nil && b {
				err = fmt.Errorf("fp16.fp16_master_weights_and_grads: true is not supported (master weights are always fp32)")
			}
		default:
			err = fmt.Errorf("fp16.%s: not supported by qvd", k)
		}
		if err != nil {
			return err
		}
	}
	if on {
		if c.Train.Precision == "bf16" {
			return fmt.Errorf("fp16.enabled: fp16 and bf16 cannot both be enabled")
		}
		c.Train.Precision = "fp16"
	}
	return nil
}

func dsOptimizer(c *Config, raw json.RawMessage) error {
	typ, params, err := typeAndParams(raw, "optimizer")
	if err != nil {
		return err
	}
	o := optim.DefaultConfig()
	o.Threads = c.Optimizer.Threads
	adamWMode := true // DeepSpeed's Adam is AdamW unless adam_w_mode is false
	switch strings.ToLower(typ) {
	case "adam":
		o.Type = "adamw"
	case "adamw":
		o.Type = "adamw"
	case "sgd":
		o.Type = "sgd"
		o.Momentum = 0 // torch.optim.SGD's default
	default:
		return fmt.Errorf("optimizer.type: %q is not supported by qvd (want Adam, AdamW or SGD)", typ)
	}
	o.WeightDecay = 0 // DeepSpeed/torch default
	for _, k := range sortedKeys(params) {
		v := params[k]
		var err error
		switch k {
		case "lr":
			err = number(v, "optimizer.params.lr", &o.LR)
		case "betas":
			var b []float64
			if err = json.Unmarshal(v, &b); err == nil && len(b) != 2 {
				err = fmt.Errorf("want 2 values, got %d", len(b))
			}
			if err != nil {
				err = fmt.Errorf("optimizer.params.betas: %v", err)
			} else {
				o.Betas = [2]float64{b[0], b[1]}
			}
		case "eps":
			err = number(v, "optimizer.params.eps", &o.Eps)
		case "weight_decay":
			err = number(v, "optimizer.params.weight_decay", &o.WeightDecay)
		case "momentum":
			err = number(v, "optimizer.params.momentum", &o.Momentum)
		case "nesterov":
			err = json.Unmarshal(v, &o.Nesterov)
		case "adam_w_mode":
			err = json.Unmarshal(v, &adamWMode)
		case "torch_adam", "fused":
			// Implementation choices of DeepSpeed's Adam; the math is the same.
		default:
			err = fmt.Errorf("optimizer.params.%s: not supported by qvd", k)
		}
		if err != nil {
			return err
		}
	}
	if strings.EqualFold(typ, "adam") && !adamWMode {
		o.Type = "adam"
	}
	c.Optimizer = o
	return nil
}

func dsScheduler(c *Config, raw json.RawMessage) error {
	typ, params, err := typeAndParams(raw, "scheduler")
	if err != nil {
		return err
	}
	s := trainer.DefaultScheduleConfig()
	s.WarmupType = "log" // DeepSpeed's default warmup_type
	// DeepSpeed defaults.
	minLR, maxLR := 0.0, 0.001
	maxSet := false
	s.WarmupSteps = 1000
	var allowed []string
	switch typ {
	case "WarmupLR":
		s.Type = trainer.ScheduleWarmup
		allowed = []string{"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration"}
	case "WarmupDecayLR":
		s.Type = trainer.ScheduleWarmupLinear
		allowed = []string{"warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps", "last_batch_iteration"}
	case "WarmupCosineLR":
		s.Type = trainer.ScheduleWarmupCosine
		s.MinRatio = 0.0001 // DeepSpeed's cos_min_ratio default
		allowed = []string{"total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio", "warmup_type", "last_batch_iteration"}
	default:
		return fmt.Errorf("scheduler.type: %q is not supported by qvd (want WarmupLR, WarmupDecayLR or WarmupCosineLR)", typ)
	}
	for _, k := range sortedKeys(params) {
		v := params[k]
		name := "scheduler.params." + k
		if !contains(allowed, k) {
			return fmt.Errorf("%s: not a parameter of %s in qvd (allowed: %s)", name, typ, strings.Join(allowed, ", "))
		}
		var err error
		switch k {
		case "warmup_min_lr":
			err = number(v, name, &minLR)
		case "warmup_max_lr":
			err = number(v, name, &maxLR)
			maxSet = true
		case "warmup_num_steps":
			err = integer(v, name, &s.WarmupSteps)
		case "warmup_type":
			err = json.Unmarshal(v, &s.WarmupType)
		case "total_num_steps":
			err = integer(v, name, &s.TotalSteps)
		case "warmup_min_ratio":
			err = number(v, name, &s.WarmupStartRatio)
		case "cos_min_ratio":
			err = number(v, name, &s.MinRatio)
		case "last_batch_iteration":
			var it int
			if err = integer(v, name, &it); err == nil && it != -1 {
				err = fmt.Errorf("%s: only -1 (start from the beginning) is supported; resume with --resume instead", name)
			}
		}
		if err != nil {
			return err
		}
	}
	if typ != "WarmupCosineLR" {
		// The Warmup*LR schedulers carry their own peak lr, which overrides the optimizer's.
		if maxSet || c.Optimizer.LR == 0 {
			c.Optimizer.LR = maxLR
		}
		if !(maxLR > 0) {
			return fmt.Errorf("scheduler.params.warmup_max_lr: must be > 0, got %v", maxLR)
		}
		if minLR < 0 || minLR > maxLR {
			return fmt.Errorf("scheduler.params.warmup_min_lr: must be in [0, warmup_max_lr], got %v", minLR)
		}
		s.WarmupStartRatio = minLR / maxLR
		s.MinRatio = minLR / maxLR // WarmupDecayLR decays back to warmup_min_lr
	}
	c.Scheduler = s
	return nil
}

func dsZero(c *Config, raw json.RawMessage) ([]string, error) {
	obj, err := object(raw, "zero_optimization")
	if err != nil {
		return nil, err
	}
	var warns []string
	for _, k := range sortedKeys(obj) {
		v := obj[k]
		name := "zero_optimization." + k
		var err error
		switch k {
		case "stage":
			err = integer(v, name, &c.Zero.Stage)
		case "reduce_bucket_size":
			var f float64
			if err = number(v, name, &f); err == nil {
				c.Zero.ReduceBucketSize = int64(f)
			}
		case "overlap_comm":
			if e := json.Unmarshal(v, &c.Zero.OverlapComm); e != nil {
				err = fmt.Errorf("%s: want true or false, got %s", name, string(v))
			}
		case "allgather_bucket_size":
			var f float64
			if err = number(v, name, &f); err == nil {
				c.Zero.AllgatherBucketSize = int64(f)
			}
		case "offload_optimizer":
			var off map[string]json.RawMessage
			if off, err = object(v, name); err != nil {
				return nil, err
			}
			for _, ok := range sortedKeys(off) {
				switch ok {
				case "device":
					err = json.Unmarshal(off[ok], &c.Zero.OffloadOptimizer.Device)
				case "pin_memory", "buffer_count", "fast_init", "ratio":
					warns = append(warns, fmt.Sprintf("deepspeed key %q has no effect in qvd", name+"."+ok))
				default:
					err = fmt.Errorf("%s.%s: not supported by qvd", name, ok)
				}
				if err != nil {
					return nil, err
				}
			}
		default:
			if dsZeroIgnored[k] {
				warns = append(warns, fmt.Sprintf("deepspeed key %q has no effect in qvd", name))
				continue
			}
			err = fmt.Errorf("%s: not supported by qvd (supported: stage, offload_optimizer.device, reduce_bucket_size, allgather_bucket_size)", name)
		}
		if err != nil {
			return nil, err
		}
	}
	return warns, nil
}

// ---- small JSON helpers with errors that name the key ----

// duplicateKeys walks the first JSON value of text as a token stream and reports the first
// key an object defines twice, with its path and both lines:
// "zero_optimization.stage (line 7): key already defined at line 4". Text that is not JSON
// is left to the decoder's own error (nil here).
func duplicateKeys(text []byte) error {
	dec := json.NewDecoder(bytes.NewReader(text))
	dec.UseNumber() // numbers are skipped, not parsed
	lines := lineIndex(text)
	var walk func(path string) (dup error, ok bool)
	walk = func(path string) (error, bool) {
		tok, err := dec.Token()
		if err != nil {
			return nil, false
		}
		switch tok {
		case json.Delim('{'):
			seen := map[string]int{}
			for dec.More() {
				kt, err := dec.Token()
				if err != nil {
					return nil, false
				}
				k, _ := kt.(string)
				key, line := join(path, k), lines(dec.InputOffset())
				if first, dup := seen[k]; dup {
					return fmt.Errorf("%s (line %d): key already defined at line %d", key, line, first), true
				}
				seen[k] = line
				if dup, ok := walk(key); dup != nil || !ok {
					return dup, ok
				}
			}
		case json.Delim('['):
			for i := 0; dec.More(); i++ {
				if dup, ok := walk(fmt.Sprintf("%s[%d]", path, i)); dup != nil || !ok {
					return dup, ok
				}
			}
		default:
			return nil, true // a scalar
		}
		_, err = dec.Token() // the closing '}' or ']'
		return nil, err == nil
	}
	dup, _ := walk("")
	return dup
}

// lineIndex returns a function from a byte offset in text to its 1-based line.
func lineIndex(text []byte) func(offset int64) int {
	var starts []int64 // offsets just after each newline
	for i, c := range text {
		if c == '\n' {
			starts = append(starts, int64(i+1))
		}
	}
	return func(offset int64) int {
		return 1 + sort.Search(len(starts), func(i int) bool { return starts[i] > offset })
	}
}

// typeAndParams splits DeepSpeed's {"type": ..., "params": {...}} blocks.
func typeAndParams(raw json.RawMessage, name string) (typ string, params map[string]json.RawMessage, err error) {
	obj, err := object(raw, name)
	if err != nil {
		return "", nil, err
	}
	params = map[string]json.RawMessage{}
	for _, k := range sortedKeys(obj) {
		switch k {
		case "type":
			if err := json.Unmarshal(obj[k], &typ); err != nil {
				return "", nil, fmt.Errorf("%s.type: want a string: %v", name, err)
			}
		case "params":
			if params, err = object(obj[k], name+".params"); err != nil {
				return "", nil, err
			}
		default:
			return "", nil, fmt.Errorf("%s.%s: not supported by qvd (want type and params)", name, k)
		}
	}
	return typ, params, nil
}

func object(raw []byte, name string) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&m); err != nil || m == nil {
		if err == nil {
			err = fmt.Errorf("null")
		}
		return nil, fmt.Errorf("%s: want a JSON object: %v", name, err)
	}
	return m, nil
}

func enabled(raw json.RawMessage, name string, obj map[string]json.RawMessage) (bool, error) {
	if obj == nil {
		var err error
		if obj, err = object(raw, name); err != nil {
			return false, err
		}
	}
	v, ok := obj["enabled"]
	if !ok {
		if name == "bf16" || name == "bfloat16" {
			for k := range obj {
				if k != "enabled" {
					return false, fmt.Errorf("%s.%s: not supported by qvd", name, k)
				}
			}
		}
		return false, nil
	}
	var on bool
	if err := json.Unmarshal(v, &on); err != nil {
		var s string
		if json.Unmarshal(v, &s) == nil && s == "auto" {
			return false, fmt.Errorf("%s.enabled: \"auto\" needs a value; set true or false", name)
		}
		return false, fmt.Errorf("%s.enabled: want true or false: %v", name, err)
	}
	return on, nil
}

func number(raw json.RawMessage, name string, dst *float64) error {
	var f float64
	if err := json.Unmarshal(raw, &f); err != nil {
		return fmt.Errorf("%s: want a number, got %s", name, string(raw))
	}
	if math.IsNaN(f) || math.IsInf(f, 0) {
		return fmt.Errorf("%s: want a finite number", name)
	}
	*dst = f
	return nil
}

func integer(raw json.RawMessage, name string, dst *int) error {
	var f float64
	if err := number(raw, name, &f); err != nil {
		return err
	}
	if f != math.Trunc(f) || math.Abs(f) > 1<<40 {
		return fmt.Errorf("%s: want an integer, got %s", name, string(raw))
	}
	*dst = int(f)
	return nil
}

// intOrAuto parses a batch figure; "auto" (Hugging Face's placeholder) leaves it unset.
func intOrAuto(raw json.RawMessage, name string, dst *int) error {
	var s string
	if json.Unmarshal(raw, &s) == nil && s == "auto" {
		return nil
	}
	if err := integer(raw, name, dst); err != nil {
		return err
	}
	if *dst < 1 {
		return fmt.Errorf("%s: must be >= 1, got %d", name, *dst)
	}
	return nil
}

func sortedKeys(m map[string]json.RawMessage) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
