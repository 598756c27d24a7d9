package configs

// Overrides are the settings a command line gives over a config file. A nil field leaves
// the config's value. They come last: defaults < YAML < DeepSpeed JSON < overrides (Load
// applies them in that order). Validation is the config's, after all of them (job.Resolve).
type Overrides struct {
	MicroBatch     *int // train.micro_batch; trainer.AutoMicroBatch is auto
	EffectiveBatch *int // train.effective_batch
	Accum          *int // train.accum
	Precision      *string
	Epochs         *int
	LR             *float64 // optimizer.lr
	Out            *string  // run.out
	Seed           *uint64  // run.seed
	MaxSteps       *int64
	Threads        *int // train.threads and optimizer.threads
	TrainSubset    *int
	TestSubset     *int
	DataPath       *string // data.path
	Transport      *string // collective.transport
	Device         *string // device.type
	Engine         *string
	ZeroStage      *int
	Offload        *string // zero_optimization.offload_optimizer.device
	// CheckpointEvery is checkpoint.every_steps.
	CheckpointEvery *int
	// Recompute is model.activation_checkpointing.segments.
	Recompute     *int
	MetricsAddr   *string // monitoring.metrics_addr
	DashboardAddr *string // dashboard.addr
}

// Apply sets c's fields from the overrides given, and records in ds that the micro-batch and
// the accumulation were given explicitly when they were (CheckBatch and micro_batch: auto
// need to know).
func (o Overrides) Apply(c *Config, ds *DeepSpeedResult) {
	set := func(dst *int, v *int) {
		if v != nil {
			*dst = *v
		}
	}
	setS := func(dst *string, v *string) {
		if v != nil {
			*dst = *v
		}
	}
	if o.MicroBatch != nil {
		c.Train.MicroBatch, ds.MicroSet = *o.MicroBatch, true
	}
	if o.Accum != nil {
		c.Train.Accum, ds.AccumSet = *o.Accum, true
	}
	if o.Threads != nil {
		c.Train.Threads, c.Optimizer.Threads = *o.Threads, *o.Threads
	}
	if o.LR != nil {
		c.Optimizer.LR = *o.LR
	}
	if o.Seed != nil {
		c.Run.Seed = *o.Seed
	}
	if o.MaxSteps != nil {
		c.Train.MaxSteps = *o.MaxSteps
	}
	set(&c.Train.EffectiveBatch, o.EffectiveBatch)
	set(&c.Train.Epochs, o.Epochs)
	set(&c.Data.TrainSubset, o.TrainSubset)
	set(&c.Data.TestSubset, o.TestSubset)
	set(&c.Zero.Stage, o.ZeroStage)
	set(&c.Checkpoint.EverySteps, o.CheckpointEvery)
	set(&c.Model.Recompute.Segments, o.Recompute)
	setS(&c.Train.Precision, o.Precision)
	setS(&c.Run.Out, o.Out)
	setS(&c.Data.Path, o.DataPath)
	setS(&c.Collective.Transport, o.Transport)
	setS(&c.Device.Type, o.Device)
	setS(&c.Engine, o.Engine)
	setS(&c.Zero.OffloadOptimizer.Device, o.Offload)
	setS(&c.Monitoring.MetricsAddr, o.MetricsAddr)
	setS(&c.Dashboard.Addr, o.DashboardAddr)
}

// Load builds a configuration before validation: the defaults, the config name (a YAML file
// or an embedded config; "" is DefaultName), the DeepSpeed JSON at deepspeed if not "", then
// o. The result says what the JSON and o set explicitly.
func (o Overrides) Load(name, deepspeed string) (Config, DeepSpeedResult, error) {
	if name == "" {
		name = DefaultName
	}
	var ds DeepSpeedResult
	cfg, err := Load(name)
	if err != nil {
		return cfg, ds, err
	}
	if deepspeed != "" {
		if ds, err = LoadDeepSpeed(&cfg, deepspeed); err != nil {
			return cfg, ds, err
		}
	}
	o.Apply(&cfg, &ds)
	return cfg, ds, nil
}
