package rundir

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/checkpoint"
)

func TestLockExclusive(t *testing.T) {
	dir := t.TempDir()
	l, stale, err := Acquire(dir)
	if err != nil || stale != nil {
		t.Fatalf("Acquire = %v, stale %v", err, stale)
	}
	// flock excludes another open file description, even in this process.
	_, _, err = Acquire(dir)
	var le *LockedError
	if !errors.As(err, &le) || !errors.Is(err, ErrLocked) {
		t.Fatalf("second Acquire = %v, want a LockedError", err)
	}
	me := self(time.Now())
	if le.Holder.PID != me.PID || le.Holder.Host != me.Host || le.Holder.Since.IsZero() {
		t.Fatalf("holder %+v, want pid %d on %s", le.Holder, me.PID, me.Host)
	}
	for _, want := range []string{dir, "pid", me.Host, "since", LockFile} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if err := l.Release(); err != nil {
		t.Errorf("second Release = %v", err)
	}
	l, stale, err = Acquire(dir)
	if err != nil || stale != nil {
		t.Fatalf("Acquire after Release = %v, stale %v (a released lock is not stale)", err, stale)
	}
	l.Release()
}

// deadPID returns the pid of a process that has exited.
func deadPID(t *testing.T) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skipf("cannot run true: %v", err)
	}
	return cmd.Process.Pid
}

func writeRecord(t *testing.T, dir string, h Holder) {
	t.Helper()
	b, _ := json.Marshal(h)
	if err := os.WriteFile(filepath.Join(dir, LockFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestLockStale(t *testing.T) {
	me := self(time.Now())
	since := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)

	// A dead process of this host: taken over, reported.
	dir := t.TempDir()
	dead := Holder{PID: deadPID(t), Host: me.Host, Since: since}
	writeRecord(t, dir, dead)
	l, stale, err := Acquire(dir)
	if err != nil || stale == nil || *stale != dead {
		t.Fatalf("Acquire over a dead holder = %v, stale %v; want it taken over", err, stale)
	}
	l.Release()

	// A live process of this host (this test's parent: a reused pid) that does not hold the
	// flock: the kernel says the lock is free, so the record is stale.
	dir = t.TempDir()
	live := Holder{PID: os.Getppid(), Host: me.Host, Since: since}
	writeRecord(t, dir, live)
	if l, stale, err := Acquire(dir); err != nil || stale == nil || *stale != live {
		t.Fatalf("Acquire over a reused pid whose flock is free = %v, stale %v; want it taken over", err, stale)
	} else {
		l.Release()
	}
	// On a filesystem without flock the record alone decides: a running pid is honoured.
	dir = t.TempDir()
	writeRecord(t, dir, live)
	if _, _, err := acquireNoFlock(dir, me); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "is running") {
		t.Fatalf("Acquire without flock over a running pid = %v, want ErrLocked", err)
	}

	// Another host: cannot be checked, honoured.
	dir = t.TempDir()
	writeRecord(t, dir, Holder{PID: 1234, Host: "elsewhere", Since: since})
	if _, _, err := Acquire(dir); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "host elsewhere") {
		t.Fatalf("Acquire over another host's record = %v, want ErrLocked naming the host", err)
	}

	// A torn record (a crash mid-write) is no holder.
	dir = t.TempDir()
	os.WriteFile(filepath.Join(dir, LockFile), []byte(`{"pid": 12`), 0o644)
	if l, stale, err := Acquire(dir); err != nil || stale != nil {
		t.Fatalf("Acquire over a torn record = %v, %v", err, stale)
	} else {
		l.Release()
	}
}

// acquireNoFlock is Acquire on a filesystem without flock (NFS without a lock manager).
func acquireNoFlock(dir string, me Holder) (*Lock, *Holder, error) {
	return acquire(dir, me, processAlive, func(int) error { return syscall.ENOLCK })
}

// fakeRun leaves what a run leaves in dir: a checkpoint of run id and metrics.
func fakeRun(t *testing.T, dir, id string) {
	t.Helper()
	ck := filepath.Join(dir, "checkpoints")
	os.MkdirAll(ck, 0o755)
	if err := checkpoint.WriteRunID(ck, id); err != nil {
		t.Fatal(err)
	}
	m, err := checkpoint.NewManager(ck, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Save(4, map[string]func(io.Writer) error{
		"model.safetensors": func(w io.Writer) error { _, err := w.Write([]byte("w")); return err },
	}, nil); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "metrics.jsonl"), []byte(`{"kind":"train","step":1}`+"\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "train.log"), []byte("log\n"), 0o644)
}

func opts(dir string) Options {
	return Options{Dir: dir, CheckpointDir: filepath.Join(dir, "checkpoints"), MetricsFile: filepath.Join(dir, "metrics.jsonl")}
}

func TestOpenFreshAndOverwrite(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "run")
	r, err := Open(opts(dir))
	if err != nil || r.ID == "" {
		t.Fatalf("Open of a new directory = %v, %+v", err, r)
	}
	if id, _ := checkpoint.ReadRunID(filepath.Join(dir, "checkpoints")); id != r.ID {
		t.Fatalf("recorded run id %q, want %q", id, r.ID)
	}
	// Held: a second run is refused.
	if _, err := Open(opts(dir)); !errors.Is(err, ErrLocked) {
		t.Fatalf("Open of a held directory = %v, want ErrLocked", err)
	}
	first := r.ID
	fakeRun(t, dir, first)
	r.Close()

	// A fresh start over a finished run: refused, nothing touched.
	if _, err := Open(opts(dir)); !errors.Is(err, ErrRunExists) || !strings.Contains(err.Error(), first) ||
		!strings.Contains(err.Error(), "--resume auto") || !strings.Contains(err.Error(), "--overwrite") {
		t.Fatalf("fresh Open over a run = %v, want ErrRunExists naming the run and the two ways out", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "checkpoints", "step-00000004")); err != nil {
		t.Fatal(err)
	}
	// Overwrite with resume makes no sense.
	o := opts(dir)
	o.Overwrite, o.Resume = true, "auto"
	if _, err := Open(o); !errors.Is(err, ErrInvalidOptions) {
		t.Fatalf("Open with --overwrite and --resume = %v", err)
	}

	// Resume auto: same run.
	o = opts(dir)
	o.Resume = "auto"
	r, err = Open(o)
	if err != nil || r.ID != first {
		t.Fatalf("Open with resume auto = %v, run %q; want %q", err, r.ID, first)
	}
	r.Close()

	// Overwrite: everything moves aside, the new run starts empty.
	o = opts(dir)
	o.Overwrite = true
	o.Now = func() time.Time { return time.Date(2026, 11, 24, 10, 15, 0, 0, time.UTC) }
	r, err = Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	aside := dir + ".old-20261124T101500"
	if len(r.MovedAside) != 1 || r.MovedAside[0].To != aside || r.ID == first {
		t.Fatalf("overwrite: moved %+v, run %s", r.MovedAside, r.ID)
	}
	for _, name := range []string{"metrics.jsonl", "train.log", "checkpoints/step-00000004/meta.json", "checkpoints/run-id"} {
		if _, err := os.Stat(filepath.Join(aside, name)); err != nil {
			t.Errorf("the old run's %s was not moved aside: %v", name, err)
		}
	}
	entries, _ := os.ReadDir(dir)
	var left []string
	for _, e := range entries {
		left = append(left, e.Name())
	}
	if strings.Join(left, " ") != ".qvd.lock checkpoints" {
		t.Errorf("after overwrite the run directory holds %v", left)
	}
	if id, _ := checkpoint.ReadRunID(filepath.Join(dir, "checkpoints")); id != r.ID {
		t.Errorf("recorded run id %q, want the new %q", id, r.ID)
	}
}

func TestOpenResumeNamedCheckpoint(t *testing.T) {
	a, b := filepath.Join(t.TempDir(), "a"), filepath.Join(t.TempDir(), "b")
	fakeRun(t, a, "run-a")
	fakeRun(t, b, "run-b")
	ckA := filepath.Join(a, "checkpoints", "step-00000004")

	// Into a directory holding another run: refused.
	o := opts(b)
	o.Resume = ckA
	if _, err := Open(o); !errors.Is(err, checkpoint.ErrOtherRun) || !strings.Contains(err.Error(), "run-a") {
		t.Fatalf("resume of run-a's checkpoint into run-b's directory = %v, want ErrOtherRun", err)
	}
	// Into a new directory: continues run a there.
	o = opts(filepath.Join(t.TempDir(), "c"))
	o.Resume = ckA
	r, err := Open(o)
	if err != nil || r.ID != "run-a" {
		t.Fatalf("resume into a new directory = %v, run %q", err, r.ID)
	}
	r.Close()
	// Into its own directory: same run.
	o = opts(a)
	o.Resume = ckA
	if r, err = Open(o); err != nil || r.ID != "run-a" {
		t.Fatalf("resume in place = %v, run %q", err, r.ID)
	}
	r.Close()
}

// TestOpenSeparateCheckpointDir: a checkpoint.dir outside the run directory is locked too.
func TestOpenSeparateCheckpointDir(t *testing.T) {
	root := t.TempDir()
	o := Options{Dir: filepath.Join(root, "out1"), CheckpointDir: filepath.Join(root, "ckpt"), MetricsFile: filepath.Join(root, "out1", "metrics.jsonl")}
	r, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	o2 := o
	o2.Dir, o2.MetricsFile = filepath.Join(root, "out2"), filepath.Join(root, "out2", "metrics.jsonl")
	if _, err := Open(o2); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "ckpt") {
		t.Fatalf("a second run sharing checkpoint.dir = %v, want ErrLocked on it", err)
	}
	// The failed Open released what it had taken: out2 is free.
	l, _, err := Acquire(o2.Dir)
	if err != nil {
		t.Fatalf("out2 still locked after the failed Open: %v", err)
	}
	l.Release()
}
