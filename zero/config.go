package zero

import "fmt"

// Config is DeepSpeed's zero_optimization block (YAML `zero_optimization:`).
type Config struct {
	// Stage is 0 (data parallel), 1 (optimizer state sharded) or 2 (and gradients sharded).
	Stage            int           `yaml:"stage" json:"stage"`
	OffloadOptimizer OffloadConfig `yaml:"offload_optimizer" json:"offload_optimizer"`
	// ReduceBucketSize is the number of elements reduced per collective call (the gradient
	// all-reduce at stages 0-1, the reduce-scatter at stage 2); 0 (the default) sizes it from
	// the model, the world and the stage (AutoReduceBucketElems), and the trainer logs what
	// it chose.
	ReduceBucketSize int64 `yaml:"reduce_bucket_size" json:"reduce_bucket_size"`
	// AllgatherBucketSize is the number of elements per parameter all-gather at stages 1-2;
	// 0 sizes it from the model and the world (AutoBucketElems).
	AllgatherBucketSize int64 `yaml:"allgather_bucket_size" json:"allgather_bucket_size"`
	// OverlapComm reduces each gradient bucket as soon as the backward pass has written it,
	// while the pass goes on (the default, DeepSpeed's overlap_comm), and at stages 1-2 leaves
	// the parameters' all-gather running under the next forward pass (Engine.Prefetching);
	// false does each inside the step, which is what the overlap is measured against.
	OverlapComm bool `yaml:"overlap_comm" json:"overlap_comm"`
}

// OffloadConfig says where the optimizer state lives and the optimizer step runs.
type OffloadConfig struct {
	Device string `yaml:"device" json:"device"` // none | cpu
}

// DefaultConfig is stage 0 without offload, with buckets sized from the model.
func DefaultConfig() Config {
	return Config{OffloadOptimizer: OffloadConfig{Device: "none"}, OverlapComm: true}
}

// Validate checks the block; errors name the field.
func (c Config) Validate() error {
	switch {
	case c.Stage < 0 || c.Stage > 2:
		return fmt.Errorf("stage: must be 0, 1 or 2 (ZeRO-3 parameter partitioning is not supported), got %d", c.Stage)
	case c.OffloadOptimizer.Device != "none" && c.OffloadOptimizer.Device != "cpu":
		return fmt.Errorf("offload_optimizer.device: must be none or cpu, got %q", c.OffloadOptimizer.Device)
	case c.ReduceBucketSize < 0 || c.ReduceBucketSize > 1<<40:
		return fmt.Errorf("reduce_bucket_size: must be 0 (sized from the model) or between 1 and 2^40 elements, got %d", c.ReduceBucketSize)
	case c.AllgatherBucketSize < 0 || c.AllgatherBucketSize > 1<<40:
		return fmt.Errorf("allgather_bucket_size: must be 0 (sized from the model) or between 1 and 2^40 elements, got %d", c.AllgatherBucketSize)
	}
	return nil
}

// Offload says whether the optimizer state and step are moved to host memory.
func (c Config) Offload() bool { return c.OffloadOptimizer.Device == "cpu" }
