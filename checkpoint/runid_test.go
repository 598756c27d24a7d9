package checkpoint

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// tamper rewrites meta.json through a generic JSON tree, as a person with an editor (or a
// damaged disk) would, without touching the checksum.
func tamper(t *testing.T, dir string, edit func(doc map[string]any)) {
	t.Helper()
	p := filepath.Join(dir, "meta.json")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	edit(doc)
	if b, err = json.MarshalIndent(doc, "", "  "); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestMetaChecksum: any change to a value of meta.json, the caller's metadata included, makes
// the checkpoint corrupt (named by meta.json), so Latest falls back past it; whitespace does
// not matter; a version 1 meta.json (before checksums) still opens.
func TestMetaChecksum(t *testing.T) {
	edits := []struct {
		name string
		edit func(doc map[string]any)
	}{
		{"caller step", func(doc map[string]any) { doc["meta"].(map[string]any)["step"] = 1000 }},
		{"caller field one character", func(doc map[string]any) { doc["meta"].(map[string]any)["note"] = "hellp" }},
		{"caller field added", func(doc map[string]any) { doc["meta"].(map[string]any)["optimizer"] = "sgd" }},
		{"file list", func(doc map[string]any) { doc["files"] = doc["files"].([]any)[:1] }},
		{"created", func(doc map[string]any) { doc["created"] = "2001-01-01T00:00:00Z" }},
		{"run id", func(doc map[string]any) { doc["run_id"] = "someone-else" }},
		{"checksum removed", func(doc map[string]any) { delete(doc, "checksum") }},
		{"checksum garbage", func(doc map[string]any) { doc["checksum"] = "sha256:00" }},
	}
	for _, tc := range edits {
		t.Run(tc.name, func(t *testing.T) {
			m := newManager(t, 0)
			save(t, m, 100)
			newest := save(t, m, 200)
			tamper(t, newest, tc.edit)
			_, err := Open(newest)
			var ce *CorruptError
			if !errors.As(err, &ce) || ce.File != "meta.json" || !strings.Contains(err.Error(), "checksum") {
				t.Fatalf("Open of a tampered meta.json = %v, want a CorruptError naming meta.json and the checksum", err)
			}
			c, skipped, err := Latest(m.Dir())
			if err != nil || c.Step() != 100 || len(skipped) != 1 || !errors.Is(skipped[0], ErrCorrupt) {
				t.Fatalf("Latest = %v, %v, %v; want step 100 with the tampered one skipped", c, skipped, err)
			}
		})
	}

	t.Run("whitespace only", func(t *testing.T) {
		m := newManager(t, 0)
		dir := save(t, m, 5)
		tamper(t, dir, func(map[string]any) {}) // re-indented, keys re-ordered
		if _, err := Open(dir); err != nil {
			t.Fatalf("Open after re-formatting meta.json = %v", err)
		}
	})

	t.Run("version 1 without checksum", func(t *testing.T) {
		m := newManager(t, 0)
		dir := save(t, m, 5)
		tamper(t, dir, func(doc map[string]any) { doc["version"] = 1; delete(doc, "checksum") })
		c, err := Open(dir)
		if err != nil || c.Step() != 5 {
			t.Fatalf("Open of a version 1 meta.json = %v, %v", c, err)
		}
		// But a version 1 file that carries a checksum is held to it.
		tamper(t, dir, func(doc map[string]any) { doc["checksum"] = "sha256:00" })
		if _, err := Open(dir); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("Open of a version 1 meta.json with a wrong checksum = %v, want ErrCorrupt", err)
		}
	})
}

// saveTiny saves a checkpoint with one small file.
func saveTiny(t *testing.T, m *Manager, step int64) string {
	t.Helper()
	path, err := m.Save(step, map[string]func(io.Writer) error{
		"model.safetensors": func(w io.Writer) error { _, err := w.Write([]byte("weights of step ")); return err },
	}, map[string]int64{"step": step})
	if err != nil {
		t.Fatalf("Save(%d): %v", step, err)
	}
	return path
}

// TestPruneKeepsValidCheckpoints: a corrupt checkpoint does not count towards keep, so it
// never costs a valid one; it ages out like the others.
func TestPruneKeepsValidCheckpoints(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "checkpoints")
	m, err := NewManager(dir, 2)
	if err != nil {
		t.Fatal(err)
	}
	saveTiny(t, m, 1)
	p2 := saveTiny(t, m, 2)
	os.Truncate(filepath.Join(p2, "model.safetensors"), 3)

	// The next process (a resume from step 1, since 2 is corrupt) saves step 3. Counting the
	// corrupt step 2, keep=2 would remove step 1 and leave a single valid checkpoint.
	m, err = NewManager(dir, 2)
	if err != nil {
		t.Fatal(err)
	}
	saveTiny(t, m, 3)
	if got := mustList(t, m); !slices.Equal(got, []int64{1, 2, 3}) {
		t.Fatalf("after saving step 3 with keep=2 and step 2 corrupt, List() = %v, want [1 2 3]", got)
	}
	// Two valid checkpoints newer than both: the corrupt one and the oldest go.
	saveTiny(t, m, 4)
	if got := mustList(t, m); !slices.Equal(got, []int64{3, 4}) {
		t.Fatalf("after saving step 4, List() = %v, want [3 4]", got)
	}
}

// TestRunIDs: a Manager stamps its directory's run id into every checkpoint; Latest skips
// other runs' checkpoints (reporting them) and accepts ones from before run ids; pruning
// leaves other runs' checkpoints alone.
func TestRunIDs(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "checkpoints")
	os.MkdirAll(dir, 0o755)
	old := NewRunID(time.Now())
	if err := WriteRunID(dir, old); err != nil {
		t.Fatal(err)
	}
	m, err := NewManager(dir, 1)
	if err != nil || m.RunID() != old {
		t.Fatalf("NewManager = %v, run id %q, want %q", err, m.RunID(), old)
	}
	p := saveTiny(t, m, 30)
	if id, err := RunIDOf(p); err != nil || id != old {
		t.Fatalf("RunIDOf = %q, %v; want %q", id, err, old)
	}

	// A new run in the same directory (its owner records the new id): the old run's step
	// 30 is newer than anything of the new run, but never resumed nor pruned.
	cur := NewRunID(time.Now())
	if cur == old {
		t.Fatalf("two run ids in a row are both %q", cur)
	}
	if err := WriteRunID(dir, cur); err != nil {
		t.Fatal(err)
	}
	m, err = NewManager(dir, 1)
	if err != nil {
		t.Fatal(err)
	}
	saveTiny(t, m, 10)
	saveTiny(t, m, 20)
	if got := mustList(t, m); !slices.Equal(got, []int64{20, 30}) {
		t.Fatalf("List() = %v, want [20 30]: the new run's step 10 pruned, the old run's 30 untouched", got)
	}
	c, skipped, err := Latest(dir)
	if err != nil || c.Step() != 20 || c.RunID() != cur {
		t.Fatalf("Latest = %v, %v; want step 20 of run %s", c, err, cur)
	}
	if len(skipped) != 1 || !errors.Is(skipped[0], ErrOtherRun) || !strings.Contains(skipped[0].Error(), old) {
		t.Fatalf("skipped = %v, want step 30 of run %s", skipped, old)
	}
	// An explicit path is the user's choice: no run check.
	if c, _, err := Resolve(p, dir); err != nil || c.Step() != 30 {
		t.Fatalf("Resolve(%s) = %v, %v", p, c, err)
	}

	// A checkpoint from before run ids (no run_id in meta.json) belongs to any run.
	tamper(t, filepath.Join(dir, StepDirName(30)), func(doc map[string]any) {
		delete(doc, "run_id")
		delete(doc, "checksum")
		doc["version"] = 1
	})
	if c, _, err := Latest(dir); err != nil || c.Step() != 30 {
		t.Fatalf("Latest with a pre-run-id checkpoint = %v, %v; want step 30", c, err)
	}

	if err := WriteRunID(dir, "../escape"); err == nil {
		t.Errorf("WriteRunID accepted a run id with a path in it")
	}
	os.WriteFile(filepath.Join(dir, RunIDFile), []byte("bad/id\n"), 0o644)
	if _, err := NewManager(dir, 1); err == nil {
		t.Errorf("NewManager accepted a damaged %s", RunIDFile)
	}
}

// TestPendingDirsDoNotCollide: two runs saving the same step into one directory at the same
// moment get distinct pending directories, and beginning one never removes the other's.
// (With the fixed name .tmp-step-%08d-shared the second BeginShared removed the first's.)
func TestPendingDirsDoNotCollide(t *testing.T) {
	dir := t.TempDir()
	var ms []*Manager
	for range 2 {
		if err := WriteRunID(dir, NewRunID(time.Now())); err != nil {
			t.Fatal(err)
		}
		m, err := NewManager(dir, 0)
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
	}
	a, err := ms[0].BeginShared(7)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.WriteFile("model.safetensors", func(w io.Writer) error { _, err := w.Write([]byte("a")); return err }); err != nil {
		t.Fatal(err)
	}
	b, err := ms[1].BeginShared(7)
	if err != nil {
		t.Fatal(err)
	}
	if a.Dir() == b.Dir() || !strings.Contains(a.Dir(), ms[0].RunID()) {
		t.Fatalf("pending dirs %s and %s", a.Dir(), b.Dir())
	}
	if _, err := a.Commit(nil); err != nil {
		t.Fatalf("the first run's save after the second began the same step: %v", err)
	}
	// Begin: unique per call even within one run.
	c1, _ := ms[1].Begin(9)
	c2, _ := ms[1].Begin(9)
	if c1.Dir() == c2.Dir() || !strings.Contains(filepath.Base(c1.Dir()), ms[1].RunID()) {
		t.Fatalf("Begin gave %s and %s", c1.Dir(), c2.Dir())
	}
}
