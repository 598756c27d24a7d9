package elastic

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Config is the elastic section. With MinNodes 0 (the default) the job is fixed-size: a
// lost member ends it.
type Config struct {
	// MinNodes is the smallest world the job keeps training at after losing members; 0
	// turns elastic training off.
	MinNodes int `yaml:"min_nodes" json:"min_nodes"`
	// MaxNodes is the largest world; the job starts when MaxNodes members are present (this
	// increment does not admit members later).
	MaxNodes int `yaml:"max_nodes" json:"max_nodes"`
	// Settle is how long a survivor waits after a loss before it re-forms. The default, 0,
	// waits for nothing: survivors need not agree on who is left before they start, since
	// the coordinator's roster decides (it leaves out the members any survivor found gone
	// and those that do not answer it within 2 s), and a survivor that awaits a lost
	// coordinator takes over as soon as gossip declares it gone. A settle only delays
	// recovery; it remains for a network where survivors see a loss at very different times.
	Settle time.Duration `yaml:"settle" json:"settle"`
	// KeepGlobalBatch raises or lowers gradient accumulation at the new world so that
	// micro_batch × accum × world stays the same; when that is impossible the re-form fails
	// saying why. false continues with the nearest accumulation, with a warning.
	KeepGlobalBatch bool `yaml:"keep_global_batch" json:"keep_global_batch"`
	// RejoinTimeout is how long a group below MinNodes waits for members to come back
	// before it fails.
	RejoinTimeout time.Duration `yaml:"rejoin_timeout" json:"rejoin_timeout"`
	// SnapshotEvery is how often, in steps, each rank copies its ZeRO shard (stages 1-2) to
	// its ring neighbour, so that a lost rank's shard is rebuilt from memory rather than from
	// the newest checkpoint: 0 (the default) chooses the interval by measurement, every step
	// when that costs under 5% of the step time; -1 turns the snapshots off. A recovery from
	// them loses at most SnapshotEvery steps.
	SnapshotEvery int `yaml:"snapshot_every" json:"snapshot_every"`
}

// MaxSnapshotEvery bounds snapshot_every.
const MaxSnapshotEvery = 100000

// SnapshotSteps reads SnapshotEvery: the interval in steps, or auto (measure it), or neither
// (0, false: snapshots off).
func (c Config) SnapshotSteps() (every int, auto bool) {
	switch {
	case c.SnapshotEvery == 0:
		return 0, true
	case c.SnapshotEvery < 0:
		return 0, false
	}
	return c.SnapshotEvery, false
}

// DefaultConfig is fixed-size training; the other fields are the values an elastic job
// gets when it sets only min_nodes and max_nodes.
func DefaultConfig() Config {
	return Config{KeepGlobalBatch: true, RejoinTimeout: 30 * time.Second}
}

// Enabled reports whether a lost member leaves the job training.
func (c Config) Enabled() bool { return c.MinNodes > 0 }

// MaxWorld bounds min_nodes and max_nodes (the cluster's largest roster).
const MaxWorld = 65535

// Validate names the field and its allowed range.
func (c Config) Validate() error {
	switch {
	case c.MinNodes < 0 || c.MinNodes > MaxWorld:
		return fmt.Errorf("min_nodes: must be in [0, %d] (0: elastic training off), got %d", MaxWorld, c.MinNodes)
	case c.MaxNodes < 0 || c.MaxNodes > MaxWorld:
		return fmt.Errorf("max_nodes: must be in [0, %d], got %d", MaxWorld, c.MaxNodes)
	case c.MinNodes > 0 && c.MaxNodes < c.MinNodes:
		return fmt.Errorf("max_nodes: must be >= min_nodes (%d), got %d", c.MinNodes, c.MaxNodes)
	case c.MinNodes == 0 && c.MaxNodes > 0:
		return fmt.Errorf("min_nodes: must be set (>= 1) with max_nodes %d", c.MaxNodes)
	case c.Settle < 0 || c.Settle > time.Hour:
		return fmt.Errorf("settle: must be in [0s, 1h], got %v", c.Settle)
	case c.RejoinTimeout < 0 || c.RejoinTimeout > 24*time.Hour:
		return fmt.Errorf("rejoin_timeout: must be in [0s, 24h], got %v", c.RejoinTimeout)
	case c.SnapshotEvery < -1 || c.SnapshotEvery > MaxSnapshotEvery:
		return fmt.Errorf("snapshot_every: must be -1 (off), 0 (auto) or 1 to %d steps, got %d", MaxSnapshotEvery, c.SnapshotEvery)
	}
	return nil
}

// ErrRange is ParseRange's error for a malformed or inconsistent --nodes value.
var ErrRange = errors.New("bad node range")

// ParseRange reads a --nodes value: "N" (fixed-size: min and max 0, world N) or "MIN:MAX"
// (torchrun's --nnodes convention: elastic, starting at MAX). The error names the problem.
func ParseRange(s string) (world, minNodes, maxNodes int, err error) {
	num := func(what, v string) (int, error) {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > MaxWorld {
			return 0, fmt.Errorf("--nodes %s: %w: %s must be an integer in [1, %d], got %q", s, ErrRange, what, MaxWorld, v)
		}
		return n, nil
	}
	lo, hi, ranged := strings.Cut(s, ":")
	if !ranged {
		n, err := num("N", s)
		return n, 0, 0, err
	}
	if minNodes, err = num("MIN", lo); err != nil {
		return 0, 0, 0, err
	}
	if maxNodes, err = num("MAX", hi); err != nil {
		return 0, 0, 0, err
	}
	if minNodes > maxNodes {
		return 0, 0, 0, fmt.Errorf("--nodes %s: %w: MIN must be <= MAX", s, ErrRange)
	}
	return maxNodes, minNodes, maxNodes, nil
}

// Nodes is the --nodes flag, a flag.Value: World is N, or MAX of MIN:MAX; Min and Max are
// set only by a range (an elastic job); Given reports that the flag was set.
type Nodes struct {
	World, Min, Max int
	Given           bool
}

func (n *Nodes) String() string {
	if n == nil {
		return "1"
	}
	if n.Min > 0 {
		return fmt.Sprintf("%d:%d", n.Min, n.Max)
	}
	return strconv.Itoa(n.World)
}

// Set parses N or MIN:MAX (ParseRange).
func (n *Nodes) Set(s string) error {
	w, lo, hi, err := ParseRange(s)
	if err != nil {
		return err
	}
	*n = Nodes{World: w, Min: lo, Max: hi, Given: true}
	return nil
}

// Apply makes a given flag decide c's node range: --nodes N a fixed-size job (elastic off),
// MIN:MAX an elastic one.
func (n Nodes) Apply(c *Config) {
	if n.Given {
		c.MinNodes, c.MaxNodes = n.Min, n.Max
	}
}
