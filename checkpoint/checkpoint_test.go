package checkpoint

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

type testMeta struct {
	Step  int64   `json:"step"`
	Epoch float64 `json:"epoch"`
	Note  string  `json:"note"`
}

func newManager(t *testing.T, keep int) *Manager {
	t.Helper()
	m, err := NewManager(filepath.Join(t.TempDir(), "checkpoints"), keep)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func modelTensors(step int64) []Tensor {
	return []Tensor{
		{Name: "fc.weight", Shape: []int{2, 3}, Data: []float32{1, 2, 3, 4, 5, float32(step)}},
		{Name: "fc.bias", Shape: []int{2}, Data: []float32{-1, float32(step)}},
	}
}

// save writes a typical checkpoint: a model file, an optimizer shard and the caller's meta.
func save(t *testing.T, m *Manager, step int64) string {
	t.Helper()
	path, err := m.Save(step, map[string]func(io.Writer) error{
		"model.safetensors": func(w io.Writer) error {
			return WriteSafetensors(w, modelTensors(step), map[string]string{"format": "pt"})
		},
		"optimizer-00000.safetensors": func(w io.Writer) error {
			return WriteSafetensors(w, []Tensor{{Name: "exp_avg", Shape: []int{8}, Data: make([]float32, 8)}}, nil)
		},
	}, testMeta{Step: step, Epoch: float64(step) / 100, Note: "hello"})
	if err != nil {
		t.Fatalf("Save(%d): %v", step, err)
	}
	return path
}

func mustList(t *testing.T, m *Manager) []int64 {
	t.Helper()
	steps, err := m.List()
	if err != nil {
		t.Fatal(err)
	}
	return steps
}

func TestConfig(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Errorf("DefaultConfig().Validate() = %v", err)
	}
	if d := DefaultConfig(); d.EverySteps != 500 || d.Keep != 3 || d.Dir != "" {
		t.Errorf("DefaultConfig() = %+v", d)
	}
	err := Config{EverySteps: -1, Keep: -2}.Validate()
	for _, field := range []string{"every_steps", "keep", "got -1", "got -2"} {
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("Validate() = %v, want it to mention %q", err, field)
		}
	}
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero Config (save only at the end, keep all) should be valid: %v", err)
	}
	c := Config{EverySteps: 100}
	for step, want := range map[int64]bool{0: false, 1: false, 99: false, 100: true, 200: true, 250: false} {
		if got := c.Due(step); got != want {
			t.Errorf("Due(%d) = %v, want %v", step, got, want)
		}
	}
	if (Config{}).Due(100) {
		t.Errorf("EverySteps 0 should never be due")
	}
}

func TestStepDirName(t *testing.T) {
	if got := StepDirName(400); got != "step-00000400" {
		t.Errorf("StepDirName(400) = %q", got)
	}
	for name, want := range map[string]int64{"step-00000000": 0, "step-00000400": 400, "step-123456789": 123456789} {
		if got, ok := parseStepDirName(name); !ok || got != want {
			t.Errorf("parseStepDirName(%q) = %d, %v; want %d", name, got, ok, want)
		}
	}
	for _, name := range []string{"step-400", "step-00000400.bak", "step-", "step--0000001", "step-+0000001", "xstep-00000001",
		".tmp-step-00000001-123", "step-099999999", "step-99999999999999999999"} {
		if got, ok := parseStepDirName(name); ok {
			t.Errorf("parseStepDirName(%q) = %d, want rejection", name, got)
		}
	}
}

func TestSaveOpen(t *testing.T) {
	m := newManager(t, 0)
	path := save(t, m, 400)
	if want := filepath.Join(m.Dir(), "step-00000400"); path != want {
		t.Errorf("Save returned %q, want %q", path, want)
	}
	c, err := Open(path)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	if c.Path() != path || c.Step() != 400 {
		t.Errorf("Path, Step = %q, %d", c.Path(), c.Step())
	}
	if age := time.Since(c.Created()); age < -time.Minute || age > time.Minute {
		t.Errorf("Created() = %v, not now", c.Created())
	}
	var meta testMeta
	if err := c.Meta(&meta); err != nil || meta != (testMeta{Step: 400, Epoch: 4, Note: "hello"}) {
		t.Errorf("Meta = %+v, %v", meta, err)
	}
	files := c.Files()
	if len(files) != 2 || files[0].Name != "model.safetensors" || files[1].Name != "optimizer-00000.safetensors" {
		t.Fatalf("Files() = %+v", files)
	}
	for _, fi := range files {
		b, err := os.ReadFile(filepath.Join(path, fi.Name))
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(b)
		if fi.Size != int64(len(b)) || fi.SHA256 != hex.EncodeToString(sum[:]) {
			t.Errorf("%s recorded as %+v; on disk %d bytes, sha256 %x", fi.Name, fi, len(b), sum)
		}
	}
	f, err := c.Safetensors("model.safetensors")
	if err != nil {
		t.Fatal(err)
	}
	w := make([]float32, 6)
	if err := f.ReadInto("fc.weight", w, []int{2, 3}); err != nil || w[5] != 400 {
		t.Errorf("restored fc.weight = %v, %v", w, err)
	}
	if _, err := c.FilePath("nope.bin"); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), "nope.bin") {
		t.Errorf("FilePath of an unrecorded name: %v", err)
	}
	if _, err := c.Safetensors("nope.bin"); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Safetensors of an unrecorded name: %v", err)
	}
	if p, err := c.FilePath("model.safetensors"); err != nil || p != filepath.Join(path, "model.safetensors") {
		t.Errorf("FilePath = %q, %v", p, err)
	}
	// No temporary directories are left behind.
	entries, _ := os.ReadDir(m.Dir())
	if len(entries) != 1 {
		t.Errorf("checkpoint dir holds %v, want only step-00000400", entries)
	}
}

func TestMetaJSONLayout(t *testing.T) {
	m := newManager(t, 0)
	path := save(t, m, 7)
	b, err := os.ReadFile(filepath.Join(path, "meta.json"))
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]json.RawMessage
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	keys := make([]string, 0, len(doc))
	for k := range doc {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if want := []string{"checksum", "created", "files", "format", "meta", "step", "version"}; !slices.Equal(keys, want) {
		t.Errorf("meta.json keys = %v, want %v", keys, want)
	}
	for k, want := range map[string]string{"format": `"qvd-checkpoint"`, "version": "2", "step": "7"} {
		if string(doc[k]) != want {
			t.Errorf("meta.json %s = %s, want %s", k, doc[k], want)
		}
	}
	var created string
	json.Unmarshal(doc["created"], &created)
	if _, err := time.Parse(time.RFC3339, created); err != nil {
		t.Errorf("created %q is not RFC 3339: %v", created, err)
	}
	var files []map[string]any
	json.Unmarshal(doc["files"], &files)
	if len(files) != 2 || files[0]["name"] != "model.safetensors" || files[0]["size"] == nil || len(files[0]["sha256"].(string)) != 64 {
		t.Errorf("files = %v", files)
	}
}

func TestListAndKeep(t *testing.T) {
	m := newManager(t, 3)
	for _, step := range []int64{100, 200, 300} {
		save(t, m, step)
	}
	// Foreign names, files and temporary directories are neither listed nor pruned.
	for _, name := range []string{"notes", "step-400", "step-00000100.bak"} {
		if err := os.Mkdir(filepath.Join(m.Dir(), name), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(m.Dir(), "step-00000900"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := mustList(t, m); !slices.Equal(got, []int64{100, 200, 300}) {
		t.Fatalf("List() = %v", got)
	}
	save(t, m, 400)
	save(t, m, 500)
	if got := mustList(t, m); !slices.Equal(got, []int64{300, 400, 500}) {
		t.Errorf("after keep=3 pruning, List() = %v, want [300 400 500]", got)
	}
	for _, name := range []string{"notes", "step-400", "step-00000100.bak", "step-00000900"} {
		if _, err := os.Stat(filepath.Join(m.Dir(), name)); err != nil {
			t.Errorf("pruning removed a foreign entry %s: %v", name, err)
		}
	}
	// A save of an older step (after resuming from it) is never the one pruned.
	save(t, m, 250)
	if got := mustList(t, m); !slices.Equal(got, []int64{250, 300, 400, 500}) {
		t.Errorf("after saving an older step, List() = %v, want the new one kept", got)
	}

	all := newManager(t, 0)
	for step := int64(1); step <= 5; step++ {
		save(t, all, step)
	}
	if got := mustList(t, all); len(got) != 5 {
		t.Errorf("keep=0 kept %v, want all 5", got)
	}
}

func TestListMissingDir(t *testing.T) {
	m := newManager(t, 0)
	os.RemoveAll(m.Dir())
	if _, err := m.List(); err == nil {
		t.Errorf("List of a removed directory should fail")
	}
}

func TestReplaceSameStep(t *testing.T) {
	m := newManager(t, 2)
	save(t, m, 100)
	first := save(t, m, 200)
	_, err := m.Save(200, map[string]func(io.Writer) error{
		"model.safetensors": func(w io.Writer) error {
			return WriteSafetensors(w, []Tensor{{Name: "only", Shape: []int{1}, Data: []float32{42}}}, nil)
		},
	}, testMeta{Note: "second"})
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(first)
	if err != nil {
		t.Fatalf("the replacement does not verify: %v", err)
	}
	var meta testMeta
	c.Meta(&meta)
	if meta.Note != "second" || len(c.Files()) != 1 {
		t.Errorf("after replacing, meta %+v files %+v: the old checkpoint is still there", meta, c.Files())
	}
	if got := mustList(t, m); !slices.Equal(got, []int64{100, 200}) {
		t.Errorf("List() = %v", got)
	}
	entries, _ := os.ReadDir(m.Dir())
	if len(entries) != 2 {
		t.Errorf("leftovers after replacing: %v", entries)
	}
}

// corruptions each damage one file of a saved checkpoint; Open must report that file.
func TestOpenDetectsCorruption(t *testing.T) {
	tests := []struct {
		name   string
		damage func(t *testing.T, dir string)
		file   string
		reason string
	}{
		{"truncated", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "model.safetensors")
			st, _ := os.Stat(p)
			if err := os.Truncate(p, st.Size()-4); err != nil {
				t.Fatal(err)
			}
		}, "model.safetensors", "file truncated or modified"},
		{"flipped byte", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "optimizer-00000.safetensors")
			b, _ := os.ReadFile(p)
			b[len(b)-1] ^= 1
			if err := os.WriteFile(p, b, 0o644); err != nil {
				t.Fatal(err)
			}
		}, "optimizer-00000.safetensors", "sha256 mismatch (file truncated or modified)"},
		{"deleted", func(t *testing.T, dir string) {
			if err := os.Remove(filepath.Join(dir, "model.safetensors")); err != nil {
				t.Fatal(err)
			}
		}, "model.safetensors", "missing"},
		{"replaced by a directory", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "model.safetensors")
			os.Remove(p)
			os.Mkdir(p, 0o755)
		}, "model.safetensors", "not a regular file"},
		{"meta.json garbage", func(t *testing.T, dir string) {
			if err := os.WriteFile(filepath.Join(dir, "meta.json"), []byte(`{"format": "qvd-che`), 0o644); err != nil {
				t.Fatal(err)
			}
		}, "meta.json", "invalid JSON"},
		{"meta.json truncated to nothing", func(t *testing.T, dir string) {
			os.Truncate(filepath.Join(dir, "meta.json"), 0)
		}, "meta.json", "invalid JSON"},
		{"meta.json deleted", func(t *testing.T, dir string) {
			os.Remove(filepath.Join(dir, "meta.json"))
		}, "meta.json", "missing"},
		{"meta.json of another program", func(t *testing.T, dir string) {
			os.WriteFile(filepath.Join(dir, "meta.json"), []byte(`{"format":"other","version":1}`), 0o644)
		}, "meta.json", `format "other"`},
		{"meta.json names a path outside", func(t *testing.T, dir string) {
			editMeta(t, dir, func(mj *metaJSON) { mj.Files[0].Name = "../../etc/passwd" })
		}, "meta.json", "invalid file name"},
		{"meta.json bad checksum", func(t *testing.T, dir string) {
			editMeta(t, dir, func(mj *metaJSON) { mj.Files[0].SHA256 = "xyz" })
		}, "meta.json", "64 lowercase hex"},
		{"meta.json step disagrees with the directory", func(t *testing.T, dir string) {
			editMeta(t, dir, func(mj *metaJSON) { mj.Step = 999 })
		}, "meta.json", "records step 999"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newManager(t, 0)
			dir := save(t, m, 400)
			tc.damage(t, dir)
			_, err := Open(dir)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Open = %v, want ErrCorrupt", err)
			}
			var ce *CorruptError
			if !errors.As(err, &ce) || ce.File != tc.file || ce.Path != dir {
				t.Fatalf("Open = %#v, want a CorruptError for %s in %s", err, tc.file, dir)
			}
			want := fmt.Sprintf("checkpoint %s: %s: ", dir, tc.file)
			if msg := err.Error(); !strings.HasPrefix(msg, want) || !strings.Contains(msg, tc.reason) {
				t.Fatalf("Open = %q, want %q…%q", msg, want, tc.reason)
			}
			t.Log(err)
		})
	}
}

func editMeta(t *testing.T, dir string, edit func(*metaJSON)) {
	t.Helper()
	p := filepath.Join(dir, "meta.json")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var mj metaJSON
	if err := json.Unmarshal(b, &mj); err != nil {
		t.Fatal(err)
	}
	edit(&mj)
	// Re-seal, so that the checks behind the checksum are what is tested.
	if mj.Checksum != "" {
		if mj.Checksum, err = mj.checksum(); err != nil {
			t.Fatal(err)
		}
	}
	if b, err = json.Marshal(mj); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestOpenUnknownVersion(t *testing.T) {
	m := newManager(t, 0)
	save(t, m, 100)
	dir := save(t, m, 200)
	editMeta(t, dir, func(mj *metaJSON) { mj.Version = metaVersion + 1 })
	_, err := Open(dir)
	if err == nil || errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), fmt.Sprintf("version %d is not supported", metaVersion+1)) {
		t.Fatalf("Open of a version %d checkpoint = %v, want a plain unsupported-version error", metaVersion+1, err)
	}
	// Latest must not fall back past a checkpoint it cannot read: that would resume from
	// older state without anyone noticing.
	if c, _, err := Latest(m.Dir()); err == nil || c != nil {
		t.Errorf("Latest = %v, %v; want the version error", c, err)
	}
}

func TestOpenNotACheckpoint(t *testing.T) {
	_, err := Open(filepath.Join(t.TempDir(), "nope"))
	if err == nil || errors.Is(err, ErrCorrupt) {
		t.Errorf("Open of a missing directory = %v, want a plain not-exist error", err)
	}
	if !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Open of a missing directory = %v, want fs.ErrNotExist", err)
	}
}

func TestCheckpointSafetensorsRechecksHash(t *testing.T) {
	m := newManager(t, 0)
	dir := save(t, m, 1)
	c, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "model.safetensors")
	b, _ := os.ReadFile(p)
	b[len(b)-1] ^= 0x80
	os.WriteFile(p, b, 0o644)
	if _, err := c.Safetensors("model.safetensors"); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Safetensors after the file changed = %v, want ErrCorrupt", err)
	}
}

func TestLatestFallsBack(t *testing.T) {
	m := newManager(t, 0)
	save(t, m, 100)
	save(t, m, 200)
	newest := save(t, m, 300)
	os.Truncate(filepath.Join(newest, "model.safetensors"), 10)

	c, skipped, err := Latest(m.Dir())
	if err != nil {
		t.Fatal(err)
	}
	if c.Step() != 200 {
		t.Errorf("Latest = step %d, want 200", c.Step())
	}
	if len(skipped) != 1 || !errors.Is(skipped[0], ErrCorrupt) ||
		!strings.Contains(skipped[0].Error(), "step-00000300: model.safetensors: size 10") {
		t.Errorf("skipped = %v, want the truncated step 300", skipped)
	}

	// Resolve("auto") is the same thing; an explicit path to the corrupt one is an error.
	c, skipped, err = Resolve("auto", m.Dir())
	if err != nil || c.Step() != 200 || len(skipped) != 1 {
		t.Errorf(`Resolve("auto") = %v, %v, %v`, c, skipped, err)
	}
	if _, _, err := Resolve(newest, m.Dir()); !errors.Is(err, ErrCorrupt) {
		t.Errorf("Resolve of the corrupt checkpoint by path = %v, want ErrCorrupt (no fallback)", err)
	}
	c, _, err = Resolve(filepath.Join(m.Dir(), "step-00000100"), m.Dir())
	if err != nil || c.Step() != 100 {
		t.Errorf("Resolve by path = %v, %v", c, err)
	}

	// All corrupt: ErrNoCheckpoint, with every reason reported.
	for _, step := range []int64{100, 200} {
		os.Remove(filepath.Join(m.Dir(), StepDirName(step), "meta.json"))
	}
	_, skipped, err = Latest(m.Dir())
	if !errors.Is(err, ErrNoCheckpoint) || len(skipped) != 3 {
		t.Errorf("Latest with every checkpoint corrupt = %v, skipped %v", err, skipped)
	}
}

func TestResolveNoCheckpoint(t *testing.T) {
	empty := t.TempDir()
	for _, dir := range []string{empty, filepath.Join(empty, "does-not-exist")} {
		c, skipped, err := Resolve("auto", dir)
		if !errors.Is(err, ErrNoCheckpoint) || c != nil || skipped != nil {
			t.Errorf(`Resolve("auto", %s) = %v, %v, %v; want ErrNoCheckpoint`, dir, c, skipped, err)
		}
	}
	if _, _, err := Resolve("", empty); err == nil {
		t.Errorf(`Resolve("") should fail`)
	}
	if _, _, err := Resolve(filepath.Join(empty, "step-00000001"), empty); err == nil || errors.Is(err, ErrNoCheckpoint) {
		t.Errorf("Resolve of a missing explicit path = %v, want a plain error", err)
	}
}

// TestCrashBeforeCommit simulates a process that dies while saving: the pending directory
// stays behind, half written, and must not affect List, Latest or the next save.
func TestCrashBeforeCommit(t *testing.T) {
	m := newManager(t, 2)
	save(t, m, 100)
	before := mustList(t, m)

	crashed, err := m.Begin(200)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := crashed.WriteFile("model.safetensors", func(w io.Writer) error {
		return WriteSafetensors(w, modelTensors(200), nil)
	}); err != nil {
		t.Fatal(err)
	}
	// A half-written file too, as a crash mid-write leaves.
	os.WriteFile(filepath.Join(crashed.Dir(), "optimizer-00000.safetensors"), []byte("partial"), 0o644)
	if !strings.HasPrefix(filepath.Base(crashed.Dir()), ".tmp-step-00000200-") {
		t.Errorf("pending dir %s does not follow .tmp-step-%%08d-<random>", crashed.Dir())
	}
	// The process dies here: no Commit, no Abort.

	if got := mustList(t, m); !slices.Equal(got, before) {
		t.Errorf("List() after a crash = %v, want %v", got, before)
	}
	c, skipped, err := Latest(m.Dir())
	if err != nil || c.Step() != 100 || len(skipped) != 0 {
		t.Errorf("Latest after a crash = %v, %v, %v; want step 100 and nothing skipped", c, skipped, err)
	}

	// A later pending directory (a crash after resuming from an earlier step) survives a
	// commit, since it might belong to a save in progress; an earlier one is cleaned up.
	later, err := m.Begin(900)
	if err != nil {
		t.Fatal(err)
	}
	save(t, m, 300)
	if _, err := os.Stat(crashed.Dir()); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the abandoned pending dir of step 200 survived the commit of step 300: %v", err)
	}
	if _, err := os.Stat(later.Dir()); err != nil {
		t.Errorf("the pending dir of step 900 was removed by the commit of step 300: %v", err)
	}
}

// TestCrashMidReplace simulates a crash between moving the old checkpoint of a step aside
// and renaming the new one in: the step is missing, Latest falls back to the previous one,
// and the next commit cleans up.
func TestCrashMidReplace(t *testing.T) {
	m := newManager(t, 0)
	save(t, m, 100)
	p200 := save(t, m, 200)
	aside := filepath.Join(m.Dir(), ".old-step-00000200-XYZ")
	if err := os.Rename(p200, aside); err != nil {
		t.Fatal(err)
	}
	if got := mustList(t, m); !slices.Equal(got, []int64{100}) {
		t.Errorf("List() = %v", got)
	}
	if c, _, err := Latest(m.Dir()); err != nil || c.Step() != 100 {
		t.Errorf("Latest = %v, %v", c, err)
	}
	save(t, m, 300)
	if _, err := os.Stat(aside); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("leftover %s not cleaned up by the next commit", aside)
	}
}

func TestPendingCommitOthers(t *testing.T) {
	m := newManager(t, 0)
	p, err := m.Begin(50)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Abort()
	if _, err := p.WriteFile("model.safetensors", func(w io.Writer) error {
		return WriteSafetensors(w, modelTensors(50), nil)
	}); err != nil {
		t.Fatal(err)
	}
	// Ranks 1 and 2 write their shards into the same directory and report what they wrote.
	var others []FileInfo
	for rank := 1; rank <= 2; rank++ {
		fi, err := WriteFileIn(p.Dir(), fmt.Sprintf("optimizer-%05d.safetensors", rank), func(w io.Writer) error {
			return WriteSafetensors(w, []Tensor{{Name: "m", Shape: []int{rank}, Data: make([]float32, rank)}}, nil)
		})
		if err != nil {
			t.Fatal(err)
		}
		others = append(others, fi)
	}
	path, err := p.Commit(map[string]int{"world_size": 3}, others...)
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(path)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	var names []string
	for _, fi := range c.Files() {
		names = append(names, fi.Name)
	}
	if want := []string{"model.safetensors", "optimizer-00001.safetensors", "optimizer-00002.safetensors"}; !slices.Equal(names, want) {
		t.Errorf("recorded files %v, want %v", names, want)
	}
	// The others are verified like any file.
	os.Truncate(filepath.Join(path, "optimizer-00002.safetensors"), 3)
	if _, err := Open(path); !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "optimizer-00002.safetensors") {
		t.Errorf("Open after truncating another rank's file = %v", err)
	}
	if err := p.Abort(); err != nil {
		t.Errorf("Abort after Commit = %v, want a no-op", err)
	}
	if _, err := os.Stat(path); err != nil {
		t.Errorf("Abort after Commit removed the checkpoint: %v", err)
	}
}

func TestCommitRejects(t *testing.T) {
	m := newManager(t, 0)
	begin := func() *Pending {
		p, err := m.Begin(10)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Abort() })
		return p
	}
	good, _ := WriteFileIn(t.TempDir(), "x.bin", func(w io.Writer) error { _, err := w.Write([]byte("abc")); return err })

	p := begin()
	if _, err := p.Commit(nil, FileInfo{Name: "absent.bin", Size: 3, SHA256: good.SHA256}); err == nil || !strings.Contains(err.Error(), "absent.bin") {
		t.Errorf("Commit with a missing other file = %v", err)
	}

	p = begin()
	WriteFileIn(p.Dir(), "x.bin", func(w io.Writer) error { _, err := w.Write([]byte("abcd")); return err })
	if _, err := p.Commit(nil, good); err == nil || !strings.Contains(err.Error(), "size 3, but it is 4 bytes") {
		t.Errorf("Commit with a wrongly sized other file = %v", err)
	}

	p = begin()
	os.WriteFile(filepath.Join(p.Dir(), "stray.bin"), nil, 0o644)
	if _, err := p.Commit(nil); err == nil || !strings.Contains(err.Error(), "stray.bin") {
		t.Errorf("Commit with an unrecorded file = %v", err)
	}

	p = begin()
	p.WriteFile("x.bin", func(w io.Writer) error { _, err := w.Write([]byte("abc")); return err })
	if _, err := p.Commit(nil, good); err == nil || !strings.Contains(err.Error(), "recorded twice") {
		t.Errorf("Commit with a file recorded twice = %v", err)
	}

	p = begin()
	if _, err := p.Commit(nil, FileInfo{Name: "../escape", Size: 0, SHA256: good.SHA256}); err == nil {
		t.Errorf("Commit with a path as a file name should fail")
	}

	p = begin()
	if _, err := p.Commit(func() {}); err == nil || !strings.Contains(err.Error(), "caller metadata") {
		t.Errorf("Commit with unmarshalable meta = %v", err)
	}
	if got := mustList(t, m); len(got) != 0 {
		t.Errorf("failed commits published %v", got)
	}

	p = begin()
	if _, err := p.Commit(nil); err != nil {
		t.Fatal(err)
	}
	if _, err := p.Commit(nil); err == nil {
		t.Errorf("second Commit should fail")
	}
	if _, err := p.WriteFile("late.bin", func(io.Writer) error { return nil }); err == nil {
		t.Errorf("WriteFile after Commit should fail")
	}
}

func TestWriteFile(t *testing.T) {
	m := newManager(t, 0)
	p, err := m.Begin(1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Abort()
	for _, name := range []string{"", ".", "..", "a/b", `a\b`, "meta.json", "nul\x00"} {
		if _, err := p.WriteFile(name, func(io.Writer) error { return nil }); err == nil {
			t.Errorf("WriteFile(%q) should be rejected", name)
		}
	}
	// A failing writer leaves no file behind and frees the name.
	boom := errors.New("boom")
	_, err = p.WriteFile("model.safetensors", func(w io.Writer) error {
		w.Write([]byte("partial"))
		return boom
	})
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "model.safetensors") {
		t.Errorf("WriteFile with a failing writer = %v", err)
	}
	if _, err := os.Stat(filepath.Join(p.Dir(), "model.safetensors")); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("partial file left behind: %v", err)
	}
	// Large enough to cross the write buffer several times.
	data := bytes.Repeat([]byte("0123456789abcdef"), 3*writeBufSize/16+5)
	fi, err := p.WriteFile("model.safetensors", func(w io.Writer) error {
		for b := data; len(b) > 0; b = b[min(len(b), 1000):] {
			if _, err := w.Write(b[:min(len(b), 1000)]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if fi.Size != int64(len(data)) || fi.SHA256 != hex.EncodeToString(sum[:]) || fi.Name != "model.safetensors" {
		t.Errorf("FileInfo = %+v, want size %d sha256 %x", fi, len(data), sum)
	}
	if _, err := p.WriteFile("model.safetensors", func(io.Writer) error { return nil }); err == nil {
		t.Errorf("writing the same name twice should fail")
	}
	if err := p.Abort(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p.Dir()); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Abort left %s: %v", p.Dir(), err)
	}
	if err := p.Abort(); err != nil {
		t.Errorf("second Abort = %v", err)
	}
}

func TestConcurrentWriteFile(t *testing.T) {
	m := newManager(t, 0)
	p, err := m.Begin(3)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			if _, err := p.WriteFile(fmt.Sprintf("shard-%d", i), func(w io.Writer) error {
				_, err := w.Write(bytes.Repeat([]byte{byte(i)}, 1000*i))
				return err
			}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	path, err := p.Commit(nil)
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(path)
	if err != nil || len(c.Files()) != 8 {
		t.Errorf("Open = %v files, %v", c, err)
	}
}

func TestSaveFailureLeavesNothing(t *testing.T) {
	m := newManager(t, 0)
	save(t, m, 1)
	_, err := m.Save(2, map[string]func(io.Writer) error{
		"a.bin": func(w io.Writer) error { _, err := w.Write([]byte("ok")); return err },
		"b.bin": func(io.Writer) error { return errors.New("disk full") },
	}, nil)
	if err == nil || !strings.Contains(err.Error(), "disk full") || !strings.Contains(err.Error(), "b.bin") {
		t.Errorf("Save = %v", err)
	}
	entries, _ := os.ReadDir(m.Dir())
	if len(entries) != 1 {
		t.Errorf("a failed Save left %v", entries)
	}
	if _, err := m.Begin(-1); err == nil {
		t.Errorf("Begin(-1) should fail")
	}
	if _, err := NewManager("", 1); err == nil {
		t.Errorf(`NewManager("") should fail`)
	}
}

func TestPruneFailureStillCommits(t *testing.T) {
	m := newManager(t, 1)
	save(t, m, 1)
	m.removeAll = func(string) error { return errors.New("device busy") }
	path, err := m.Save(2, map[string]func(io.Writer) error{
		"a.bin": func(w io.Writer) error { _, err := w.Write([]byte("x")); return err },
	}, nil)
	if !errors.Is(err, ErrPrune) || !strings.Contains(err.Error(), "device busy") {
		t.Fatalf("Save = %v, want ErrPrune", err)
	}
	if c, err := Open(path); err != nil || c.Step() != 2 {
		t.Errorf("the checkpoint of a commit with ErrPrune does not open: %v", err)
	}
	// The one that could not be deleted was at least moved out of the way.
	if got := mustList(t, m); !slices.Equal(got, []int64{2}) {
		t.Errorf("List() = %v, want [2]", got)
	}
	m.removeAll = os.RemoveAll
	save(t, m, 3)
	if entries, _ := os.ReadDir(m.Dir()); len(entries) != 1 {
		t.Errorf("leftovers not retried by the next commit: %v", entries)
	}
}

func TestMetaDecodeErrorAndEmptyDir(t *testing.T) {
	m := newManager(t, 0)
	c, err := Open(save(t, m, 1))
	if err != nil {
		t.Fatal(err)
	}
	var wrong []int
	if err := c.Meta(&wrong); err == nil || !strings.Contains(err.Error(), "decode metadata") {
		t.Errorf("Meta into the wrong type = %v", err)
	}
	if _, _, err := Latest(""); err == nil || errors.Is(err, ErrNoCheckpoint) {
		t.Errorf(`Latest("") = %v; an unset directory must not look like "start fresh"`, err)
	}
}

func TestBeginSharedWithFilesFromOtherRanks(t *testing.T) {
	dir := t.TempDir()
	m, err := NewManager(dir, 0)
	if err != nil {
		t.Fatal(err)
	}
	// A stale pending directory from a crashed attempt is replaced.
	os.MkdirAll(filepath.Join(SharedPendingDir(dir, "", 7), "junk"), 0o755)
	p, err := m.BeginShared(7)
	if err != nil {
		t.Fatal(err)
	}
	if p.Dir() != SharedPendingDir(dir, "", 7) {
		t.Fatalf("pending dir %s", p.Dir())
	}
	// "Rank 1" writes into the shared directory; rank 0 describes and commits it.
	if _, err := WriteFileIn(SharedPendingDir(dir, "", 7), "optimizer-00001.safetensors", func(w io.Writer) error {
		_, err := w.Write([]byte("shard one"))
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := p.WriteFile("model.safetensors", func(w io.Writer) error { _, err := w.Write([]byte("model")); return err }); err != nil {
		t.Fatal(err)
	}
	info, err := Describe(p.Dir(), "optimizer-00001.safetensors")
	if err != nil || info.Size != 9 {
		t.Fatalf("describe: %+v %v", info, err)
	}
	path, err := p.Commit(map[string]int{"x": 1}, info)
	if err != nil {
		t.Fatal(err)
	}
	c, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.Files()) != 2 {
		t.Fatalf("files %+v", c.Files())
	}
}
