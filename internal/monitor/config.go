package monitor

import "path/filepath"

// Config selects the monitors. The run config holds its two targets as the top-level keys
// `tensorboard` and `csv_monitor` (the names of DeepSpeed's keys, which map onto them).
type Config struct {
	// TensorBoard writes event files for `tensorboard --logdir`. On by default, as in PyTorch
	// Lightning: a point per step costs about 150 bytes, and the curves are there when the
	// run is worth a look.
	TensorBoard Target `yaml:"tensorboard" json:"tensorboard"`
	// CSV writes one CSV file per scalar, in the layout of DeepSpeed's csv_monitor. Off by
	// default: metrics.jsonl holds the same figures.
	CSV Target `yaml:"csv" json:"csv"`
}

// Target is one monitor's switch and directory.
type Target struct {
	Enabled bool `yaml:"enabled" json:"enabled"`
	// Dir is where its files go; empty: a directory in the run directory (tb/ or csv/).
	Dir string `yaml:"dir" json:"dir"`
}

// Default directory names inside the run directory.
const (
	TensorBoardDir = "tb"
	CSVDir         = "csv"
)

// DefaultConfig has TensorBoard on and CSV off, both in the run directory.
func DefaultConfig() Config {
	return Config{TensorBoard: Target{Enabled: true}}
}

// Resolve fills the empty directories with their defaults under runDir.
func (c *Config) Resolve(runDir string) {
	if c.TensorBoard.Dir == "" {
		c.TensorBoard.Dir = filepath.Join(runDir, TensorBoardDir)
	}
	if c.CSV.Dir == "" {
		c.CSV.Dir = filepath.Join(runDir, CSVDir)
	}
}
