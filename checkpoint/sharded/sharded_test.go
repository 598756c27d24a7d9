package sharded

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
)

// ring builds n communicators over the in-process transport.
func ring(t *testing.T, n int) []Comm {
	t.Helper()
	_, transports := collective.NewInproc(n, 1)
	cfg := collective.DefaultConfig()
	cfg.Transport = "inproc"
	cfg.Timeout = 2 * time.Second
	cfg.ChunkBytes = 4 << 10
	out := make([]Comm, n)
	for r := range n {
		c, err := collective.NewRing(transports[r], cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close(); transports[r].Close() })
		out[r] = c
	}
	return out
}

// onRanks runs f on every rank at once and returns each rank's error.
func onRanks(comms []Comm, f func(rank int, c Comm) error) []error {
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for r, c := range comms {
		wg.Go(func() { errs[r] = f(r, c) })
	}
	wg.Wait()
	return errs
}

func TestShardFile(t *testing.T) {
	for r, want := range map[int]string{0: "optimizer-00000.safetensors", 3: "optimizer-00003.safetensors", 12345: "optimizer-12345.safetensors"} {
		if got := ShardFile(r); got != want {
			t.Errorf("ShardFile(%d) = %q, want %q", r, got, want)
		}
	}
	if ModelFile != "model.safetensors" {
		t.Errorf("ModelFile = %q", ModelFile)
	}
}

// TestMetaJSONKeys pins meta.json's schema: old checkpoints must keep loading, so a key is
// never renamed.
func TestMetaJSONKeys(t *testing.T) {
	m := Meta{Scaler: &ScalerState{}, Frozen: 1, Input: []int{1}, Classes: 1, ClassNames: []string{"a"},
		Tensors: []TensorMeta{{}}, Shards: []ShardMeta{{}}}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(b, &top); err != nil {
		t.Fatal(err)
	}
	want := []string{"accum", "class_names", "classes", "config", "epoch", "epoch_offset", "flat_size", "frozen_elements", "global_batch",
		"input", "last_metrics", "loss_scaler", "micro_batch", "model", "num_params", "opt_shards", "optimizer", "optimizer_steps",
		"precision", "rng", "seed", "skipped_steps", "step", "tensors", "world_size", "zero_stage"}
	keys := func(raw json.RawMessage) []string {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		var ks []string
		for k := range m {
			ks = append(ks, k)
		}
		slices.Sort(ks)
		return ks
	}
	if got := keys(b); !slices.Equal(got, want) {
		t.Errorf("meta.json keys\n got %v\nwant %v", got, want)
	}
	if got := keys(top["loss_scaler"]); !slices.Equal(got, []string{"good_steps", "hysteresis_left", "overflows", "scale"}) {
		t.Errorf("loss_scaler keys %v", got)
	}
	var sh []json.RawMessage
	_ = json.Unmarshal(top["opt_shards"], &sh)
	if got := keys(sh[0]); !slices.Equal(got, []string{"file", "length", "offset"}) {
		t.Errorf("opt_shards keys %v", got)
	}
	var ts []json.RawMessage
	_ = json.Unmarshal(top["tensors"], &ts)
	if got := keys(ts[0]); !slices.Equal(got, []string{"name", "offset", "shape"}) {
		t.Errorf("tensors keys %v", got)
	}
	// A meta.json written before the optional fields existed still decodes.
	old := `{"step":7,"optimizer_steps":6,"skipped_steps":1,"epoch":0,"epoch_offset":64,"seed":1,"world_size":2,"zero_stage":1,
		"opt_shards":[{"file":"optimizer-00000.safetensors","offset":0,"length":10}],"loss_scaler":{"scale":1024,"good_steps":3,"hysteresis_left":2,"overflows":1}}`
	var got Meta
	if err := json.Unmarshal([]byte(old), &got); err != nil {
		t.Fatal(err)
	}
	if got.Step != 7 || got.OptimizerSteps != 6 || got.Skipped != 1 || got.EpochOffset != 64 || got.WorldSize != 2 || got.ZeroStage != 1 ||
		len(got.Shards) != 1 || got.Shards[0].Length != 10 || *got.Scaler != (ScalerState{Scale: 1024, GoodSteps: 3, HysteresisLeft: 2, Overflows: 1}) {
		t.Errorf("decoded %+v", got)
	}
}

func TestPlan(t *testing.T) {
	for _, c := range []struct {
		name    string
		plan    Plan
		writers []int
		shards  []ShardMeta
	}{
		{"one worker", Plan{Stage: 0, Trainable: 10, Bounds: []int{0, 10}}, []int{0},
			[]ShardMeta{{"optimizer-00000.safetensors", 0, 10}}},
		{"stage 0: rank 0 writes the whole state", Plan{Stage: 0, Trainable: 10, Bounds: []int{0, 16, 10}}, []int{0},
			[]ShardMeta{{"optimizer-00000.safetensors", 0, 10}}},
		{"stage 2: every rank its shard", Plan{Stage: 2, Trainable: 40, Bounds: []int{0, 16, 32, 40}}, []int{0, 1, 2},
			[]ShardMeta{{"optimizer-00000.safetensors", 0, 16}, {"optimizer-00001.safetensors", 16, 16}, {"optimizer-00002.safetensors", 32, 8}}},
		{"stage 1: empty shards write nothing", Plan{Stage: 1, Trainable: 16, Bounds: []int{0, 0, 16, 16}}, []int{1},
			[]ShardMeta{{"optimizer-00001.safetensors", 0, 16}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := c.plan.Writers(); !slices.Equal(got, c.writers) {
				t.Errorf("Writers = %v, want %v", got, c.writers)
			}
			if got := c.plan.Shards(); !reflect.DeepEqual(got, c.shards) {
				t.Errorf("Shards = %v, want %v", got, c.shards)
			}
			for r := 0; r < c.plan.World(); r++ {
				if got := c.plan.Writes(r); got != slices.Contains(c.writers, r) {
					t.Errorf("Writes(%d) = %v", r, got)
				}
			}
		})
	}
}

// stateOf is a recognisable optimizer state over the flat range [lo, hi).
func stateOf(name string, lo, hi int) []float32 {
	d := make([]float32, hi-lo)
	k := float32(len(name))
	for i := range d {
		d[i] = k*1000 + float32(lo+i)
	}
	return d
}

// writeCheckpoint commits a checkpoint whose optimizer state is split at bounds, as a group
// of len(bounds)-1 ranks at stage 2 would write it.
func writeCheckpoint(t *testing.T, dir string, bounds []int) (*checkpoint.Checkpoint, Meta) {
	t.Helper()
	mgr, err := checkpoint.NewManager(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	plan := Plan{Stage: 2, Trainable: bounds[len(bounds)-1], Bounds: bounds}
	files := map[string]func(io.Writer) error{}
	for _, r := range plan.Writers() {
		lo, hi := plan.Range(r)
		files[ShardFile(r)] = func(w io.Writer) error {
			return WriteShard(w, []Buffer{{"exp_avg", stateOf("exp_avg", lo, hi)}, {"exp_avg_sq", stateOf("exp_avg_sq", lo, hi)}},
				ShardHeader{Optimizer: "adam", Offset: lo, Length: hi - lo, Steps: 3, Rank: r, World: plan.World(), Stage: 2})
		}
	}
	meta := Meta{Step: 5, Shards: plan.Shards(), WorldSize: plan.World(), ZeroStage: 2}
	path, err := mgr.Save(5, files, meta)
	if err != nil {
		t.Fatal(err)
	}
	c, err := checkpoint.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	return c, meta
}

func TestSourceReadsAnySplit(t *testing.T) {
	c, meta := writeCheckpoint(t, t.TempDir(), []int{0, 16, 16, 48, 50})
	src, err := NewSource(c, meta.Shards, 50)
	if err != nil {
		t.Fatal(err)
	}
	f, err := c.Safetensors(ShardFile(2))
	if err != nil {
		t.Fatal(err)
	}
	if md := f.Metadata(); md["offset"] != "16" || md["length"] != "32" || md["rank"] != "2" || md["world_size"] != "4" || md["zero_stage"] != "2" || md["type"] != "adam" || md["steps"] != "3" {
		t.Errorf("shard metadata %v", md)
	}
	// Ranges as another world size cuts them: within a shard, across shards, the whole space.
	for _, r := range [][2]int{{0, 50}, {3, 9}, {10, 20}, {15, 49}, {48, 50}, {0, 25}, {25, 50}} {
		for _, name := range []string{"exp_avg", "exp_avg_sq", "exp_avg"} {
			dst := make([]float32, r[1]-r[0])
			if err := src.Read(name, r[0], dst); err != nil {
				t.Fatal(err)
			}
			if want := stateOf(name, r[0], r[1]); !slices.Equal(dst, want) {
				t.Fatalf("%s [%d, %d) = %v, want %v", name, r[0], r[1], dst, want)
			}
		}
	}
	if err := src.Read("no_such_state", 0, make([]float32, 4)); err == nil || !strings.Contains(err.Error(), "no_such_state") {
		t.Fatalf("reading a missing state: %v", err)
	}
}

func TestSourceChecksTheShards(t *testing.T) {
	c, meta := writeCheckpoint(t, t.TempDir(), []int{0, 16, 32})
	for _, tc := range []struct {
		name   string
		shards []ShardMeta
		size   int
		want   string
	}{
		{"gap", []ShardMeta{meta.Shards[0], {meta.Shards[1].File, 17, 15}}, 32, "do not tile"},
		{"short", meta.Shards[:1], 32, "cover [0, 16) of a 32-element"},
		{"missing file", []ShardMeta{meta.Shards[0], {"optimizer-00009.safetensors", 16, 16}}, 32, "optimizer-00009.safetensors [16, 32) is missing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, err := NewSource(c, tc.shards, tc.size); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewSource: %v, want an error containing %q", err, tc.want)
			}
		})
	}
	// Out of order in meta.json is fine: they are sorted by offset.
	if _, err := NewSource(c, []ShardMeta{meta.Shards[1], meta.Shards[0]}, 32); err != nil {
		t.Fatal(err)
	}
}

// TestLoadStateStreams: three ranks of another split than the checkpoint's each end with
// their own range, through chunks smaller than any shard.
func TestLoadStateStreams(t *testing.T) {
	c, meta := writeCheckpoint(t, t.TempDir(), []int{0, 16, 32, 48, 50})
	src, err := NewSource(c, meta.Shards, 50)
	if err != nil {
		t.Fatal(err)
	}
	bounds := []int{0, 0, 20, 50} // rank 0 owns nothing
	comms := ring(t, 3)
	got := make([][]Buffer, 3)
	errs := onRanks(comms, func(r int, c Comm) error {
		lo, hi := bounds[r], bounds[r+1]
		got[r] = []Buffer{{"exp_avg", make([]float32, hi-lo)}, {"exp_avg_sq", make([]float32, hi-lo)}}
		var s *Source
		if r == 0 {
			s = src
		}
		return loadState(context.Background(), c, s, 50, lo, hi, got[r], 7)
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for r := range 3 {
		for _, b := range got[r] {
			if want := stateOf(b.Name, bounds[r], bounds[r+1]); !slices.Equal(b.Data, want) {
				t.Fatalf("rank %d %s = %v, want %v", r, b.Name, b.Data, want)
			}
		}
	}
	// One worker needs no communicator.
	one := []Buffer{{"exp_avg", make([]float32, 50)}}
	if err := LoadState(context.Background(), nil, src, 50, 0, 50, one); err != nil || !slices.Equal(one[0].Data, stateOf("exp_avg", 0, 50)) {
		t.Fatalf("single worker: %v", err)
	}
}

// TestLoadStateFailsTogether: a read error on rank 0 fails every rank at the same chunk.
func TestLoadStateFailsTogether(t *testing.T) {
	dir := t.TempDir()
	c, meta := writeCheckpoint(t, dir, []int{0, 16, 32})
	src, err := NewSource(c, meta.Shards, 32)
	if err != nil {
		t.Fatal(err)
	}
	// Damage shard 1 after the checkpoint was opened: rank 0 fails to read it mid-stream.
	if err := os.WriteFile(filepath.Join(c.Path(), ShardFile(1)), []byte("garbage"), 0o644); err != nil {
		t.Fatal(err)
	}
	comms := ring(t, 2)
	errs := onRanks(comms, func(r int, c Comm) error {
		var s *Source
		if r == 0 {
			s = src
		}
		return loadState(context.Background(), c, s, 32, 16*r, 16*r+16, []Buffer{{"exp_avg", make([]float32, 16)}}, 8)
	})
	if errs[0] == nil || !strings.Contains(errs[0].Error(), ShardFile(1)) {
		t.Fatalf("rank 0: %v", errs[0])
	}
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "rank 0 could not read optimizer state exp_avg [16, 24)") {
		t.Fatalf("rank 1: %v", errs[1])
	}
}

// saveOn returns rank r's Save of a 3-rank stage-2 group into dir.
func saveOn(t *testing.T, dir string, mgr *checkpoint.Manager, r int, failShard int) Save {
	plan := Plan{Stage: 2, Trainable: 48, Bounds: []int{0, 16, 32, 48}}
	lo, hi := plan.Range(r)
	s := Save{Step: 9, Dir: dir, Plan: plan,
		WriteShard: func(w io.Writer) error {
			if r == failShard {
				return errors.New("disk full")
			}
			return WriteShard(w, []Buffer{{"exp_avg", stateOf("exp_avg", lo, hi)}}, ShardHeader{Optimizer: "adam", Offset: lo, Length: hi - lo, Rank: r, World: 3, Stage: 2})
		},
		WriteModel: func(w io.Writer) error { return checkpoint.WriteSafetensors(w, nil, nil) },
		Meta:       func() Meta { return Meta{Step: 9, Shards: plan.Shards(), WorldSize: 3, ZeroStage: 2} },
	}
	if r == 0 {
		s.Manager = mgr
	}
	return s
}

func TestSaveProtocol(t *testing.T) {
	dir := t.TempDir()
	mgr, err := checkpoint.NewManager(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	comms := ring(t, 3)
	paths := make([]string, 3)
	errs := onRanks(comms, func(r int, c Comm) (err error) {
		paths[r], err = saveOn(t, dir, mgr, r, -1).Run(context.Background(), c)
		return err
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	want := filepath.Join(dir, checkpoint.StepDirName(9))
	for r, p := range paths {
		if p != want {
			t.Fatalf("rank %d: path %q, want %q", r, p, want)
		}
	}
	c, err := checkpoint.Open(want)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, f := range c.Files() {
		names = append(names, f.Name)
	}
	if wantNames := []string{ModelFile, ShardFile(0), ShardFile(1), ShardFile(2)}; !slices.Equal(names, wantNames) {
		t.Fatalf("files %v, want %v", names, wantNames)
	}
	var m Meta
	if err := c.Meta(&m); err != nil || len(m.Shards) != 3 {
		t.Fatalf("meta %+v: %v", m, err)
	}
	src, err := NewSource(c, m.Shards, 48)
	if err != nil {
		t.Fatal(err)
	}
	all := make([]float32, 48)
	if err := src.Read("exp_avg", 0, all); err != nil || !slices.Equal(all, stateOf("exp_avg", 0, 48)) {
		t.Fatalf("read back: %v", err)
	}
}

// TestSaveFailsTogether: a rank failing to write its shard fails every rank's save, and
// nothing is published.
func TestSaveFailsTogether(t *testing.T) {
	dir := t.TempDir()
	mgr, err := checkpoint.NewManager(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	comms := ring(t, 3)
	errs := onRanks(comms, func(r int, c Comm) error {
		_, err := saveOn(t, dir, mgr, r, 2).Run(context.Background(), c)
		return err
	})
	if errs[2] == nil || !strings.Contains(errs[2].Error(), "disk full") {
		t.Fatalf("rank 2: %v", errs[2])
	}
	for _, r := range []int{0, 1} {
		if !errors.Is(errs[r], ErrSaveFailed) || !strings.Contains(errs[r].Error(), "(writing)") {
			t.Fatalf("rank %d: %v, want ErrSaveFailed in the writing phase", r, errs[r])
		}
	}
	if steps, err := checkpoint.List(dir); err != nil || len(steps) != 0 {
		t.Fatalf("checkpoints after a failed save: %v %v", steps, err)
	}
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), ".tmp-") {
			t.Fatalf("pending directory %s left behind", e.Name())
		}
	}
}

// TestSaveStageOneRankNeedsSharedDir: a rank that cannot see the pending directory rank 0
// started says why.
func TestSaveNeedsSharedDir(t *testing.T) {
	dir, elsewhere := t.TempDir(), t.TempDir()
	mgr, err := checkpoint.NewManager(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	comms := ring(t, 3)
	errs := onRanks(comms, func(r int, c Comm) error {
		d := dir
		if r == 1 {
			d = elsewhere
		}
		_, err := saveOn(t, d, mgr, r, -1).Run(context.Background(), c)
		return err
	})
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "must be a filesystem shared by all ranks") {
		t.Fatalf("rank 1: %v", errs[1])
	}
	if !errors.Is(errs[0], ErrSaveFailed) || !errors.Is(errs[2], ErrSaveFailed) {
		t.Fatalf("ranks 0, 2: %v, %v", errs[0], errs[2])
	}
}

func TestAgreeAlone(t *testing.T) {
	if err := Agree(context.Background(), nil, 3, nil, "starting"); err != nil {
		t.Fatal(err)
	}
	werr := errors.New("boom")
	if err := Agree(context.Background(), nil, 3, werr, "starting"); err != werr {
		t.Fatalf("Agree returned %v, want the rank's own error", err)
	}
}
