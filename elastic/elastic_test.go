package elastic

import (
	"errors"
	"flag"
	"io"
	"strings"
	"testing"
	"time"
)

func TestDecide(t *testing.T) {
	on := DefaultConfig()
	on.MinNodes, on.MaxNodes = 2, 4
	loose := on
	loose.KeepGlobalBatch = false
	for _, c := range []struct {
		name string
		cfg  Config
		loss Loss
		want Plan
		err  error // errors.Is
		msg  string
	}{
		{name: "stage 0 keeps training from memory", cfg: on,
			loss: Loss{OldWorld: 3, NewWorld: 2, Stage: 0, Step: 7, Checkpoint: -1, Micro: 2, Accum: 2},
			want: Plan{Action: Continue, Source: FromMemory, FromStep: 7, Accum: 3}},
		{name: "stage 0 ignores a checkpoint", cfg: on,
			loss: Loss{OldWorld: 4, NewWorld: 2, Stage: 0, Step: 7, Checkpoint: 5, Micro: 4, Accum: 1, FormerRank0: true},
			want: Plan{Action: Continue, Source: FromMemory, FromStep: 7, Accum: 2}},
		{name: "half without the former rank 0 stops", cfg: on,
			loss: Loss{OldWorld: 4, NewWorld: 2, Stage: 0, Step: 7, Checkpoint: 5, Micro: 4, Accum: 1},
			err:  ErrMinority, msg: "2 of its 4 members remain here"},
		{name: "a minority stops even with the former rank 0", cfg: on,
			loss: Loss{OldWorld: 5, NewWorld: 2, Stage: 0, Step: 7, Checkpoint: -1, Micro: 2, Accum: 5, FormerRank0: true},
			err:  ErrMinority, msg: "2 of its 5 members remain here"},
		{name: "stage 2 resumes the newest checkpoint", cfg: on,
			loss: Loss{OldWorld: 3, NewWorld: 2, Stage: 2, Step: 7, Checkpoint: 4, Micro: 2, Accum: 2},
			want: Plan{Action: Continue, Source: FromCheckpoint, FromStep: 4, LostSteps: 3, Accum: 3}},
		{name: "stage 1 without a checkpoint fails", cfg: on,
			loss: Loss{OldWorld: 3, NewWorld: 2, Stage: 1, Step: 7, Checkpoint: -1, Micro: 2, Accum: 2},
			err:  ErrNoState, msg: "checkpoint.every_steps"},
		{name: "below min_nodes waits", cfg: on,
			loss: Loss{OldWorld: 2, NewWorld: 1, Stage: 2, Step: 7, Checkpoint: -1, Micro: 2, Accum: 2, FormerRank0: true},
			want: Plan{Action: Wait}},
		{name: "stage 0 at a new world keeps the configured global batch", cfg: on,
			loss: Loss{OldWorld: 3, NewWorld: 2, Stage: 0, Step: 7, Checkpoint: -1, Micro: 2, Accum: 3, BaseWorld: 4},
			want: Plan{Action: Continue, Source: FromMemory, FromStep: 7, Accum: 6}},
		{name: "stage 2 admitting a member continues from the gathered state", cfg: on,
			loss: Loss{OldWorld: 3, NewWorld: 4, Survivors: 3, Stage: 2, Step: 9, Checkpoint: 4, Micro: 2, Accum: 2, BaseWorld: 4, Whole: true},
			want: Plan{Action: Continue, Source: FromMemory, FromStep: 9, Accum: 2}},
		{name: "stage 2 rebuilds the lost shard from its neighbour's copy", cfg: on,
			loss: Loss{OldWorld: 3, NewWorld: 2, Stage: 2, Step: 9, Checkpoint: 6, Micro: 2, Accum: 2, Snapshots: true, SnapshotStep: 8},
			want: Plan{Action: Continue, Source: FromSnapshot, FromStep: 8, LostSteps: 1, Accum: 3}},
		{name: "a newer checkpoint wins over older snapshots", cfg: on,
			loss: Loss{OldWorld: 3, NewWorld: 2, Stage: 1, Step: 9, Checkpoint: 9, Micro: 2, Accum: 2, Snapshots: true, SnapshotStep: 8},
			want: Plan{Action: Continue, Source: FromCheckpoint, FromStep: 9, Accum: 3}},
		{name: "half without rank 0 trains on when the lost half is known dead", cfg: on,
			loss: Loss{OldWorld: 4, NewWorld: 2, Stage: 0, Step: 7, Checkpoint: -1, Micro: 4, Accum: 1, Dead: 2},
			want: Plan{Action: Continue, Source: FromMemory, FromStep: 7, Accum: 2}},
		{name: "one known dead does not make 1 of 4 a quorum", cfg: on,
			loss: Loss{OldWorld: 4, NewWorld: 1, Stage: 0, Step: 7, Checkpoint: -1, Micro: 4, Accum: 1, Dead: 1},
			err:  ErrMinority, msg: "1 of its 4 members remain here and 1 are known to have ended"},
		{name: "a 2-node job goes on when its rank 0 is known dead", cfg: on,
			loss: Loss{OldWorld: 2, NewWorld: 1, Stage: 0, Step: 7, Checkpoint: -1, Micro: 4, Accum: 1, Dead: 1},
			want: Plan{Action: Wait}},
		{name: "newcomers do not make a minority a quorum", cfg: on,
			loss: Loss{OldWorld: 4, NewWorld: 4, Survivors: 1, Stage: 0, Step: 7, Checkpoint: -1, Micro: 2, Accum: 1, FormerRank0: true},
			err:  ErrMinority, msg: "1 of its 4 members remain here"},
		{name: "indivisible global batch is an error", cfg: on,
			loss: Loss{OldWorld: 4, NewWorld: 3, Step: 1, Checkpoint: -1, Micro: 2, Accum: 1},
			err:  ErrGlobalBatch, msg: "global batch is 8 (micro_batch 2 × accum 1 × world 4), not a multiple of micro_batch × new world = 2 × 3 = 6"},
		{name: "indivisible with keep_global_batch false warns", cfg: loose,
			loss: Loss{OldWorld: 4, NewWorld: 3, Step: 1, Checkpoint: -1, Micro: 2, Accum: 1},
			want: Plan{Action: Continue, Source: FromMemory, FromStep: 1, Accum: 1, Warning: "the global batch changes from 8 to 6 (micro_batch 2 × accum 1 × world 3)"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := Decide(c.cfg, c.loss)
			if c.err != nil {
				if !errors.Is(err, c.err) || !strings.Contains(err.Error(), c.msg) {
					t.Fatalf("err = %v, want %v containing %q", err, c.err, c.msg)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			w := c.want.Warning
			if w != "" && !strings.HasPrefix(got.Warning, w) {
				t.Fatalf("warning %q, want it to start %q", got.Warning, w)
			}
			got.Warning, c.want.Warning = "", ""
			if got != c.want {
				t.Fatalf("plan %+v, want %+v", got, c.want)
			}
		})
	}
}

func TestAccum(t *testing.T) {
	for _, c := range []struct {
		micro, accum, old, new int
		keep                   bool
		want                   int
		err                    bool
	}{
		{4, 1, 2, 1, true, 2, false},  // halve the world, double the accumulation
		{4, 3, 4, 2, true, 6, false},  // 48 = 4 × 6 × 2
		{2, 2, 3, 2, true, 3, false},  // 12 = 2 × 3 × 2
		{2, 1, 3, 3, true, 1, false},  // same world
		{2, 1, 2, 4, true, 0, true},   // 4 samples over 8 ranks × 2: impossible
		{2, 1, 2, 4, false, 1, false}, // nearest is at least 1
		{3, 1, 5, 4, false, 1, false}, // 15 over 12: 1.25 → 1
		{3, 3, 5, 4, false, 4, false}, // 45 over 12: 3.75 → 4
	} {
		got, warn, err := Accum(c.micro, c.accum, c.old, c.new, c.keep)
		if (err != nil) != c.err || (!c.err && got != c.want) {
			t.Errorf("Accum(%d, %d, %d → %d, keep %v) = %d, %v; want %d (error %v)", c.micro, c.accum, c.old, c.new, c.keep, got, err, c.want, c.err)
		}
		kept := c.micro*c.accum*c.old == c.micro*got*c.new
		if !c.err && kept != (warn == "") {
			t.Errorf("Accum(%d, %d, %d → %d): kept %v but warning %q", c.micro, c.accum, c.old, c.new, kept, warn)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  func(*Config)
		want string
	}{
		{func(c *Config) { c.MinNodes = -1 }, "min_nodes: must be in [0, 65535]"},
		{func(c *Config) { c.MinNodes, c.MaxNodes = 3, 2 }, "max_nodes: must be >= min_nodes (3), got 2"},
		{func(c *Config) { c.MaxNodes = 2 }, "min_nodes: must be set"},
		{func(c *Config) { c.MinNodes, c.MaxNodes, c.Settle = 1, 2, -time.Second }, "settle: must be in [0s, 1h]"},
		{func(c *Config) { c.MinNodes, c.MaxNodes, c.RejoinTimeout = 1, 2, -time.Second }, "rejoin_timeout: must be in"},
		{func(c *Config) { c.MinNodes, c.MaxNodes, c.SnapshotEvery = 1, 2, -2 }, "snapshot_every: must be -1 (off), 0 (auto) or 1 to 100000 steps, got -2"},
		{func(c *Config) { c.MinNodes, c.MaxNodes, c.SnapshotEvery = 1, 2, 100001 }, "snapshot_every: must be"},
	} {
		cfg := DefaultConfig()
		c.cfg(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: err = %v, want %q", cfg, err, c.want)
		}
	}
}

func TestSnapshotSteps(t *testing.T) {
	for _, c := range []struct {
		every, want int
		auto        bool
	}{{0, 0, true}, {-1, 0, false}, {1, 1, false}, {7, 7, false}} {
		if got, auto := (Config{SnapshotEvery: c.every}).SnapshotSteps(); got != c.want || auto != c.auto {
			t.Errorf("snapshot_every %d: (%d, %v), want (%d, %v)", c.every, got, auto, c.want, c.auto)
		}
	}
}

func TestParseRange(t *testing.T) {
	for _, c := range []struct {
		in              string
		world, min, max int
		want            string // error text, "" for none
	}{
		{in: "3", world: 3},
		{in: "2:4", world: 4, min: 2, max: 4},
		{in: "1:1", world: 1, min: 1, max: 1},
		{in: "3:2", want: "--nodes 3:2: bad node range: MIN must be <= MAX"},
		{in: "0:2", want: `MIN must be an integer in [1, 65535], got "0"`},
		{in: "2:x", want: `MAX must be an integer in [1, 65535], got "x"`},
		{in: "two", want: `N must be an integer`},
	} {
		w, lo, hi, err := ParseRange(c.in)
		if c.want != "" {
			if err == nil || !strings.Contains(err.Error(), c.want) || !errors.Is(err, ErrRange) {
				t.Errorf("ParseRange(%q): err = %v, want %q", c.in, err, c.want)
			}
			continue
		}
		if err != nil || w != c.world || lo != c.min || hi != c.max {
			t.Errorf("ParseRange(%q) = %d, %d, %d, %v", c.in, w, lo, hi, err)
		}
	}
}

func TestNodesFlag(t *testing.T) {
	for _, c := range []struct {
		args     []string
		world    int
		min, max int // what Apply writes
		str      string
	}{
		{args: nil, world: 1, min: 7, max: 9, str: "1"}, // not given: the config's range stays
		{args: []string{"--nodes", "4"}, world: 4, str: "4"},
		{args: []string{"--nodes", "2:4"}, world: 4, min: 2, max: 4, str: "2:4"},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		n := Nodes{World: 1}
		fs.Var(&n, "nodes", "")
		if err := fs.Parse(c.args); err != nil {
			t.Fatalf("%v: %v", c.args, err)
		}
		cfg := Config{MinNodes: 7, MaxNodes: 9}
		n.Apply(&cfg)
		if n.World != c.world || cfg.MinNodes != c.min || cfg.MaxNodes != c.max || n.String() != c.str {
			t.Errorf("%v: world %d, range %d:%d, %q; want %d, %d:%d, %q", c.args, n.World, cfg.MinNodes, cfg.MaxNodes, n.String(), c.world, c.min, c.max, c.str)
		}
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var n Nodes
	fs.Var(&n, "nodes", "")
	if err := fs.Parse([]string{"--nodes", "3:2"}); err == nil || !strings.Contains(err.Error(), "MIN must be <= MAX") {
		t.Errorf("--nodes 3:2: err = %v", err)
	}
}
