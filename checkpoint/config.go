package checkpoint

import (
	"errors"
	"fmt"
)

// Config is the checkpoint section of a run's configuration.
type Config struct {
	// Dir is where checkpoints go. Empty means "<run out dir>/checkpoints"; the caller, which
	// knows the run's output directory, fills it in.
	Dir string `yaml:"dir" json:"dir"`
	// EverySteps saves a checkpoint every N optimizer steps. 0 saves only at the end of the
	// run (and when it is interrupted).
	EverySteps int `yaml:"every_steps" json:"every_steps"`
	// Keep is how many of the run's newest valid checkpoints to keep; older ones are removed
	// after each save. Corrupt checkpoints do not count. 0 keeps all.
	Keep int `yaml:"keep" json:"keep"`
}

// DefaultConfig returns the defaults: a save every 500 steps, keeping the newest 3.
func DefaultConfig() Config {
	return Config{EverySteps: 500, Keep: 3}
}

// Validate reports every invalid field, naming it by its yaml name.
func (c Config) Validate() error {
	var errs []error
	if c.EverySteps < 0 {
		errs = append(errs, fmt.Errorf("every_steps: must be >= 0 (0 = save only at the end), got %d", c.EverySteps))
	}
	if c.Keep < 0 {
		errs = append(errs, fmt.Errorf("keep: must be >= 0 (0 = keep all), got %d", c.Keep))
	}
	return errors.Join(errs...)
}

// Due reports whether a checkpoint is due after optimizer step step (1-based: the step just
// completed) under the periodic schedule. Saves at the end of the run or on interrupt are
// the caller's decision.
func (c Config) Due(step int64) bool {
	return c.EverySteps > 0 && step > 0 && step%int64(c.EverySteps) == 0
}
