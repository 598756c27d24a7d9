// Package configs is qvd's run configuration: the YAML schema that composes each package's
// Config, its defaults and validation, the embedded example configs, and the mapping from a
// DeepSpeed ds_config.json.
//
// Precedence, lowest first: built-in defaults, the YAML file (-c), the DeepSpeed JSON
// (--deepspeed), command-line flags. Unknown YAML keys and unsupported DeepSpeed keys are
// errors naming the key; every value is validated with an error naming the field.
package configs

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/elastic"
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/dashboard"
	"github.com/qvd/qvd/internal/monitor"
	"github.com/qvd/qvd/internal/promexport"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/trainer"
	"github.com/qvd/qvd/zero"
)

// Config is one run's whole configuration.
type Config struct {
	Run        RunConfig              `yaml:"run" json:"run"`
	Model      model.Config           `yaml:"model" json:"model"`
	Data       data.Config            `yaml:"data" json:"data"`
	Train      trainer.Config         `yaml:"train" json:"train"`
	Optimizer  optim.Config           `yaml:"optimizer" json:"optimizer"`
	Scheduler  trainer.ScheduleConfig `yaml:"scheduler" json:"scheduler"`
	FP16       trainer.ScalerConfig   `yaml:"fp16" json:"fp16"`
	Checkpoint checkpoint.Config      `yaml:"checkpoint" json:"checkpoint"`
	Zero       zero.Config            `yaml:"zero_optimization" json:"zero_optimization"`
	Freeze     model.FreezeConfig     `yaml:"freeze" json:"freeze"`
	// InitFrom, InitMap and InitStrict initialise the weights from a safetensors file
	// (pretrained weights, another run's model.safetensors, a PyTorch state_dict) after the
	// random initialisation: see model.InitConfig. Top-level keys init_from, init_map
	// (a list of {from: REGEX, to: REPLACEMENT} renames applied in order) and init_strict.
	InitFrom   string         `yaml:"init_from" json:"init_from,omitempty"`
	InitMap    []model.Rename `yaml:"init_map" json:"init_map,omitempty"`
	InitStrict bool           `yaml:"init_strict" json:"init_strict"`
	// Cluster tunes gossip and rendezvous for multi-node jobs. node_name, bind and advertise
	// are per node: a worker takes them from its own flags, never from the job's config.
	Cluster    cluster.Config    `yaml:"cluster" json:"cluster"`
	Collective collective.Config `yaml:"collective" json:"collective"`
	// Elastic lets a multi-node job keep training when it loses members (min_nodes > 0;
	// qvd train --nodes MIN:MAX sets min_nodes and max_nodes).
	Elastic elastic.Config `yaml:"elastic" json:"elastic"`
	// TLS names this node's mutual-TLS files (ca, cert, key: all three or none). Per node,
	// like cluster.bind: a worker takes its own from --tls-* or QVD_TLS_*, never the job's.
	TLS cluster.TLSConfig `yaml:"tls" json:"tls"`
	// Memory is the memory monitor (log_every, min_available), the Go runtime's soft limit
	// and the reaction to host memory pressure.
	Memory memory.Config `yaml:"memory" json:"memory"`
	// Monitoring is the Prometheus endpoint (metrics_addr): rank r serves /metrics on the
	// address's port + r, or on a free port each with port 0; "" serves none.
	Monitoring promexport.Config `yaml:"monitoring" json:"monitoring"`
	// Dashboard is the live web page rank 0 serves while it trains (addr; "" serves none).
	Dashboard dashboard.Config `yaml:"dashboard" json:"dashboard"`
	// TensorBoard writes TensorBoard event files on rank 0 (on by default, in <run.out>/tb);
	// CSVMonitor writes one CSV file per scalar as DeepSpeed's csv_monitor does (off by
	// default, in <run.out>/csv). DeepSpeed's tensorboard and csv_monitor keys set them.
	TensorBoard monitor.Target `yaml:"tensorboard" json:"tensorboard"`
	CSVMonitor  monitor.Target `yaml:"csv_monitor" json:"csv_monitor"`
	// Device selects where the engine runs: cpu (the default), cuda (a qvd built with -tags
	// cuda) or reference (the engine's plain-Go reference device, for checking).
	Device engine.Config `yaml:"device" json:"device"`
	// Engine is native (qvd's layer engine, on every device; the default) or gorgonia (the
	// model compiled into gorgonia graphs: the independent oracle the native engine is tested
	// against, CPU only).
	Engine string `yaml:"engine" json:"engine"`
}

// Engines.
const (
	EngineNative   = "native"
	EngineGorgonia = "gorgonia"
)

// RunConfig names the run and says where its outputs go.
type RunConfig struct {
	Name string `yaml:"name" json:"name"`
	// Out is the run directory: metrics.jsonl, train.log and checkpoints/ go there.
	// Default runs/<name>.
	Out  string `yaml:"out" json:"out"`
	Seed uint64 `yaml:"seed" json:"seed"`
}

// Default returns the built-in defaults: the Fashion-MNIST MLP.
func Default() Config {
	return Config{
		Run:        RunConfig{Name: "qvd", Seed: 42},
		Model:      model.DefaultConfig(),
		Data:       data.DefaultConfig(),
		Train:      trainer.DefaultConfig(),
		Optimizer:  optim.DefaultConfig(),
		Scheduler:  trainer.DefaultScheduleConfig(),
		FP16:       trainer.DefaultScalerConfig(),
		Checkpoint: checkpoint.DefaultConfig(),
		InitStrict: model.DefaultInitConfig().Strict,
		Cluster:    clusterDefaults(),
		Collective: collective.DefaultConfig(),
		Elastic:    elastic.DefaultConfig(),
		Zero:       zero.DefaultConfig(),
		Memory:     memory.DefaultConfig(),
		Monitoring: promexport.DefaultConfig(),
		Dashboard:  dashboard.DefaultConfig(),
		Device:     engine.DefaultConfig(),
		Engine:     EngineNative,

		// TensorBoard on, CSV off: see monitor.DefaultConfig.
		TensorBoard: monitor.DefaultConfig().TensorBoard,
		CSVMonitor:  monitor.DefaultConfig().CSV,
	}
}

// placeholderKey stands in for the cluster key when the config is validated: SHA-256 bytes,
// which look random to cluster.ValidateKey, as a key from `qvd keygen` does.
var placeholderKey = sha256.Sum256([]byte("qvd: configs.Validate placeholder cluster key"))

var runName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$`)

// Validate checks every section; the error names the field as section.field.
func (c *Config) Validate() error {
	var errs []error
	add := func(section string, err error) {
		if err != nil {
			errs = append(errs, fmt.Errorf("%s.%w", section, err))
		}
	}
	if !runName.MatchString(c.Run.Name) {
		errs = append(errs, fmt.Errorf("run.name: must be 1-128 letters, digits, '.', '_' or '-', got %q", c.Run.Name))
	}
	add("model", c.Model.Validate())
	add("data", c.Data.Validate())
	add("train", c.Train.Validate())
	add("optimizer", c.Optimizer.Validate())
	add("scheduler", c.Scheduler.Validate())
	// fp16 is checked whatever the precision: a bad value in the section is a mistake even
	// while it is unused, and would surface only when the precision is switched to fp16.
	add("fp16", c.FP16.Validate())
	add("checkpoint", c.Checkpoint.Validate())
	add("zero_optimization", c.Zero.Validate())
	add("freeze", c.Freeze.Validate())
	if err := c.Init().Validate(); err != nil {
		errs = append(errs, err) // its errors name the top-level key
	}
	cc := c.Cluster
	if cc.NodeName == "" {
		cc.NodeName = "placeholder" // generated per process at start
	}
	if cc.Key == nil {
		// The key comes from a file or the environment, never the config: stand in a key
		// that passes cluster.ValidateKey's checks for a random one.
		cc.Key = placeholderKey[:]
	}
	add("cluster", cc.Validate())
	if c.Collective.Transport == collective.TransportInproc {
		// collective's own Validate accepts inproc for its tests; a job cannot use it.
		add("collective", fmt.Errorf("transport: %w (inproc is for tests)", collective.CheckTransport(c.Collective.Transport)))
	}
	add("collective", c.Collective.Validate())
	add("elastic", c.Elastic.Validate())
	add("tls", c.TLS.Validate())
	add("memory", c.Memory.Validate())
	add("monitoring", c.Monitoring.Validate())
	add("dashboard", c.Dashboard.Validate())
	add("device", c.Device.Validate())
	switch c.Engine {
	case EngineNative:
	case EngineGorgonia:
		if c.Device.Type != "cpu" {
			errs = append(errs, fmt.Errorf("engine: gorgonia runs on device.type cpu only, got device.type %q", c.Device.Type))
		}
	default:
		errs = append(errs, fmt.Errorf("engine: must be %s or %s, got %q", EngineNative, EngineGorgonia, c.Engine))
	}
	if c.Engine == EngineGorgonia && c.Freeze.Enabled() && c.Model.Recompute.Segments > 1 {
		add("freeze", errors.New("layer freezing with model.activation_checkpointing is not supported by engine gorgonia: use the native engine, or one or the other"))
	}
	if c.Collective.Transport == collective.TransportNCCL && c.Device.Type != "cuda" {
		add("collective", fmt.Errorf("transport: nccl needs device.type: cuda, got %q", c.Device.Type))
	}
	return errors.Join(errs...)
}

// Resolve fills the derived defaults: the run directory and the checkpoint directory.
func (c *Config) Resolve() {
	if c.Run.Out == "" {
		c.Run.Out = filepath.Join("runs", c.Run.Name)
	}
	if c.Checkpoint.Dir == "" {
		c.Checkpoint.Dir = filepath.Join(c.Run.Out, "checkpoints")
	}
	m := c.Monitors()
	m.Resolve(c.Run.Out)
	c.TensorBoard, c.CSVMonitor = m.TensorBoard, m.CSV
}

// Init is the weight initialisation from a file (init_from, init_map, init_strict).
func (c *Config) Init() model.InitConfig {
	return model.InitConfig{From: c.InitFrom, Map: c.InitMap, Strict: c.InitStrict}
}

// Monitors is the TensorBoard and CSV monitors' configuration.
func (c *Config) Monitors() monitor.Config {
	return monitor.Config{TensorBoard: c.TensorBoard, CSV: c.CSVMonitor}
}

// MetricsPath is where the per-step metrics go.
func (c *Config) MetricsPath() string { return filepath.Join(c.Run.Out, "metrics.jsonl") }

// LogPath is where the structured (JSON) log goes, besides stderr.
func (c *Config) LogPath() string { return filepath.Join(c.Run.Out, "train.log") }

// clusterDefaults are cluster.DefaultConfig without the per-process node name (generated at
// start, so that configs print and compare the same everywhere).
func clusterDefaults() cluster.Config {
	c := cluster.DefaultConfig()
	c.NodeName = ""
	return c
}
