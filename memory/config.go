package memory

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"
)

// Config is the memory section of a run's configuration.
type Config struct {
	// LogEvery is how often, in optimizer steps, the monitor's line is logged (besides when a
	// new peak is reached and when the host comes under pressure); 0 logs only those.
	LogEvery int `yaml:"log_every" json:"log_every"`
	// MinAvailable is the available memory below which the monitor reports pressure: a
	// share of the total ("10%") or an amount ("2GiB"); "0" turns the check off (swapping
	// and OOM kills are still reported). Available and total are the host's (MemAvailable,
	// MemTotal), or the memory cgroup's (limit less working set, limit) where its limit is
	// lower: inside docker --memory or a SLURM job.
	MinAvailable Threshold `yaml:"min_available" json:"min_available"`
	// Limit is the Go runtime's soft memory limit (runtime/debug.SetMemoryLimit) in bytes,
	// e.g. 24GiB; 0 sets none. It bounds what the Go runtime maps (heap, stacks, runtime
	// structures), not memory that C libraries allocate. `qvd train` refuses to start when
	// it is below what this rank's model states need plus headroom.
	Limit Bytes `yaml:"limit" json:"limit"`
	// Adapt asks the trainer to react to pressure by halving the micro-batch and doubling the
	// accumulation, so that the global batch stays the same.
	Adapt bool `yaml:"adapt" json:"adapt"`
}

// DefaultConfig logs every 100 steps and reports pressure below 10% available.
func DefaultConfig() Config {
	return Config{LogEvery: 100, MinAvailable: "10%"}
}

// Validate checks the fields; errors name the field and the allowed range.
func (c Config) Validate() error {
	var errs []error
	if c.LogEvery < 0 {
		errs = append(errs, fmt.Errorf("log_every: must be >= 0 steps (0 logs only peaks and pressure), got %d", c.LogEvery))
	}
	if _, _, err := c.MinAvailable.parse(); err != nil {
		errs = append(errs, fmt.Errorf("min_available: %w", err))
	}
	if c.Limit < 0 {
		errs = append(errs, fmt.Errorf("limit: must be >= 0 bytes (0 = no limit), got %d", int64(c.Limit)))
	}
	return errors.Join(errs...)
}

// Threshold is an amount of memory given either as a percentage of the machine's total
// ("10%", "2.5%") or as bytes ("2GiB", "512MiB", "1073741824"). "" and "0" mean none.
type Threshold string

// parse returns the fraction (0-1) or the bytes that t gives; one of them is zero.
func (t Threshold) parse() (fraction float64, bytes uint64, err error) {
	s := strings.TrimSpace(string(t))
	if s == "" {
		return 0, 0, nil
	}
	if p, ok := strings.CutSuffix(s, "%"); ok {
		v, err := strconv.ParseFloat(strings.TrimSpace(p), 64)
		if err != nil || math.IsNaN(v) || v < 0 || v >= 100 {
			return 0, 0, fmt.Errorf("%q is not a percentage in [0, 100)", string(t))
		}
		return v / 100, 0, nil
	}
	b, err := ParseBytes(s)
	if err != nil {
		return 0, 0, fmt.Errorf("want a percentage of the total (10%%) or a size (2GiB): %w", err)
	}
	return 0, uint64(b), nil
}

// Of resolves t against the machine's total memory: the bytes below which available memory
// counts as pressure. An invalid threshold resolves to 0 (Validate reports it).
func (t Threshold) Of(total uint64) uint64 {
	f, b, err := t.parse()
	if err != nil {
		return 0
	}
	if f > 0 {
		return uint64(f * float64(total))
	}
	return b
}

// Bytes is a byte count that a config may give as a number or with a unit: 24GiB, 16GB,
// 512MiB, 1.5GiB, 1073741824.
type Bytes int64

// byteUnits in match order: binary units before "B", so that "GiB" is not read as a count of
// "B" after "Gi". The one-letter units are binary, as in nccl-tests (-e 128M) and docker
// (--memory 512m).
var byteUnits = []struct {
	suffix string
	mul    float64
}{
	{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}, {"TiB", 1 << 40},
	{"KB", 1e3}, {"kB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}, {"B", 1},
	{"K", 1 << 10}, {"k", 1 << 10}, {"M", 1 << 20}, {"m", 1 << 20}, {"G", 1 << 30}, {"g", 1 << 30}, {"T", 1 << 40}, {"t", 1 << 40},
}

// ParseBytes parses a size: a plain number of bytes or a number with one of the units
// KiB, MiB, GiB, TiB (powers of 1024), KB (or kB), MB, GB, TB (powers of 1000), B, or the
// one-letter K, M, G, T (either case; powers of 1024). It is the one size parser of qvd:
// configs and command-line flags (qvd bench --sizes, qvd estimate --memory) use it.
func ParseBytes(s string) (Bytes, error) {
	t := strings.TrimSpace(s)
	mul := 1.0
	for _, u := range byteUnits {
		if strings.HasSuffix(t, u.suffix) {
			t, mul = strings.TrimSpace(strings.TrimSuffix(t, u.suffix)), u.mul
			break
		}
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 || v*mul > 1<<62 {
		return 0, fmt.Errorf("%q is not a size (e.g. 24GiB, 16GB, 512MiB, 512M, or bytes)", s)
	}
	return Bytes(v * mul), nil
}

// String writes b in the largest binary unit that divides it exactly ("24GiB"), else in bytes.
func (b Bytes) String() string {
	for _, u := range []struct {
		suffix string
		shift  uint
	}{{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}} {
		if b > 0 && b%(1<<u.shift) == 0 {
			return strconv.FormatInt(int64(b)>>u.shift, 10) + u.suffix
		}
	}
	return strconv.FormatInt(int64(b), 10)
}

// UnmarshalYAML takes a number of bytes or a size with a unit.
func (b *Bytes) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode {
		return fmt.Errorf("want a size (e.g. 24GiB), got a %s", map[yaml.Kind]string{yaml.SequenceNode: "list", yaml.MappingNode: "mapping"}[n.Kind])
	}
	v, err := ParseBytes(n.Value)
	if err != nil {
		return err
	}
	*b = v
	return nil
}

// MarshalYAML writes the form String gives, so that `qvd config` prints 24GiB, not 25769803776.
func (b Bytes) MarshalYAML() (any, error) {
	if s := b.String(); strings.HasSuffix(s, "B") {
		return s, nil
	}
	return int64(b), nil
}
