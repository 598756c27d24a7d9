package trainer

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/model"
)

// failingSink accepts records until step failAt, then fails every write.
type failingSink struct {
	failAt int64
	err    error
}

func (s *failingSink) Write(r metrics.Record) error {
	if r.Step >= s.failAt {
		return s.err
	}
	return nil
}

// TestResultOnSinkFailure: a failed metrics write stops the run at the step boundary with a
// checkpoint there, returns the write's error, and the result has the real counts.
func TestResultOnSinkFailure(t *testing.T) {
	r := defaultRun()
	r.cfg.MaxSteps = 12
	r.ckptDir = t.TempDir()
	werr := errors.New("writing metrics record to /x/metrics.jsonl: no space left on device")
	res, err := r.build(t, &failingSink{failAt: 3, err: werr}, nil).Run(context.Background())
	if !errors.Is(err, werr) {
		t.Fatalf("Run: %v, want the write's error", err)
	}
	if res.Interrupted || res.Steps != 3 || res.MicroBatch != r.cfg.MicroBatch || res.Accum != r.cfg.Accum || res.TotalSteps != 12 || res.Epoch == 0 {
		t.Fatalf("result %+v: want 3 steps, micro-batch %d, accum %d of 12", res, r.cfg.MicroBatch, r.cfg.Accum)
	}
	ck, _, err := checkpoint.Latest(r.ckptDir)
	if err != nil || ck.Step() != 3 || res.Checkpoint != ck.Path() {
		t.Fatalf("checkpoint %v (%v), result's %q: want step 3", ck, err, res.Checkpoint)
	}
}

// TestResultOnSinkFailureGroup: in a group, rank 0's failed write stops every rank at the
// same step, checkpointed; the other ranks fail with errPeerSink.
func TestResultOnSinkFailureGroup(t *testing.T) {
	r := defaultRun()
	r.cfg.MaxSteps = 12
	r.cfg.MicroBatch = 16
	r.ckptDir = t.TempDir()
	werr := errors.New("no space left on device")
	ts, _ := r.group(t, 2, []MetricsSink{&failingSink{failAt: 3, err: werr}, nil}, nil)
	res, errs := runAll(context.Background(), ts)
	if !errors.Is(errs[0], werr) || !errors.Is(errs[1], errPeerSink) {
		t.Fatalf("errors %v", errs)
	}
	// Rank 0 fails writing step 3's record; the others learn it with step 4's reduction.
	for i, rr := range res {
		if rr.Steps != 4 {
			t.Fatalf("rank %d stopped at step %d, want 4", i, rr.Steps)
		}
	}
	if ck, _, err := checkpoint.Latest(r.ckptDir); err != nil || ck.Step() != 4 {
		t.Fatalf("checkpoint %v (%v): want step 4", ck, err)
	}
}

// failingModel fails its forward/backward pass from call failAt on.
type failingModel struct {
	Model
	calls, failAt int
}

func (m *failingModel) ForwardBackward(b *data.Batch, scale float32, sink model.GradSink) (float32, error) {
	m.calls++
	if m.calls >= m.failAt {
		return 0, errors.New("the device fell off the bus")
	}
	return m.Model.ForwardBackward(b, scale, sink)
}

// TestResultCountsOnFailure: a run that fails mid-way reports how far it got, not zeros.
func TestResultCountsOnFailure(t *testing.T) {
	r := defaultRun()
	r.cfg.MaxSteps = 12
	r.cfg.MicroBatch, r.cfg.Accum = 16, 2
	r.newModel = func(t *testing.T, spec *model.Spec, layout *model.Layout, params []float32) Model {
		return &failingModel{Model: cpuModel(r)(t, spec, layout, params), failAt: 2*5 + 1} // in step 6
	}
	res, err := r.build(t, nil, nil).Run(context.Background())
	if err == nil {
		t.Fatal("the failing model trained without error")
	}
	if res.Steps != 5 || res.OptimizerSteps != 5 || res.MicroBatch != 16 || res.Accum != 2 || res.TotalSteps != 12 || res.Epoch == 0 {
		t.Fatalf("result %+v: want 5 steps of micro-batch 16 × accum 2", res)
	}
}

// TestResultAlreadyFinished: resuming a checkpoint at the run's last step trains nothing and
// says so.
func TestResultAlreadyFinished(t *testing.T) {
	r := defaultRun()
	r.cfg.MaxSteps = 4
	r.ckptDir = t.TempDir()
	if _, err := r.build(t, nil, nil).Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	ck, err := checkpoint.Open(filepath.Join(r.ckptDir, checkpoint.StepDirName(4)))
	if err != nil {
		t.Fatal(err)
	}
	rec := &recorder{}
	res, err := r.build(t, rec, ck).Run(context.Background())
	if err != nil || !res.AlreadyFinished || res.Steps != 4 || res.TotalSteps != 4 || len(rec.recs) != 0 {
		t.Fatalf("resumed finished run: %v %+v, %d records", err, res, len(rec.recs))
	}
}

// TestCheckDir: the start-of-run check of a directory.
func TestCheckDir(t *testing.T) {
	dir := t.TempDir()
	if err := CheckDir(dir, 1); err != nil {
		t.Fatal(err)
	}
	if err := CheckDir(dir, 1<<62); !errors.Is(err, ErrNoSpace) {
		t.Fatalf("CheckDir wanting 4 EiB: %v", err)
	}
	if err := CheckDir(filepath.Join(dir, "missing"), 1); err == nil {
		t.Fatal("CheckDir of a missing directory passed")
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Fatalf("CheckDir left %v behind", entries)
	}
	// A directory that exists but cannot be written: read-only for root (a read-only
	// tmpfs), without write permission for anyone else.
	ro := filepath.Join(dir, "ro")
	if err := os.Mkdir(ro, 0o555); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if b, err := exec.Command("mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", ro).CombinedOutput(); err != nil {
			t.Skipf("mounting a read-only tmpfs: %v %s", err, b)
		}
		defer exec.Command("umount", ro).Run()
	}
	if err := CheckDir(ro, 1); err == nil || !strings.Contains(err.Error(), "not writable") {
		t.Fatalf("CheckDir of a read-only directory: %v", err)
	}
}
