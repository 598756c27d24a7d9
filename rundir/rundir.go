package rundir

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/qvd/qvd/checkpoint"
)

// Errors callers may test for.
var (
	// ErrInvalidOptions: the Options contradict each other (a usage error).
	ErrInvalidOptions = errors.New("invalid run directory options")
	// ErrRunExists: a fresh start in a directory that holds another run's checkpoints or
	// metrics, without Overwrite.
	ErrRunExists = errors.New("run directory holds another run")
)

// Options say which directories a run uses and how it starts.
type Options struct {
	// Dir is the run directory (run.out): metrics, logs and, by default, checkpoints.
	Dir string
	// CheckpointDir is checkpoint.dir, inside Dir or not; "" when the run saves none.
	CheckpointDir string
	// MetricsFile is the run's metrics file; a non-empty one means Dir holds a run.
	MetricsFile string
	// Resume is "" for a fresh start, checkpoint.ResumeAuto, or a checkpoint directory.
	Resume string
	// Overwrite, for a fresh start, moves what the directories hold aside (never deletes).
	Overwrite bool
	// Now is the clock (the run id and the moved-aside names); nil means time.Now.
	Now func() time.Time
}

// Validate reports options that contradict each other.
func (o Options) Validate() error {
	switch {
	case o.Dir == "":
		return fmt.Errorf("%w: empty run directory", ErrInvalidOptions)
	case o.Overwrite && o.Resume != "":
		return fmt.Errorf("%w: --overwrite starts a new run and moves the old one aside; it cannot be combined with --resume %s", ErrInvalidOptions, o.Resume)
	}
	return nil
}

// Run is a run directory held by this process for one run.
type Run struct {
	// ID is the run id: new for a fresh start, kept across resumes. It is recorded in the
	// checkpoint directory's checkpoint.RunIDFile, and so in every checkpoint of the run.
	ID string
	// Stale lists locks left by processes that died, which Open took over.
	Stale []StaleLock
	// MovedAside lists what Overwrite moved away.
	MovedAside []Move

	locks []*Lock
}

// StaleLock is a lock file that recorded a dead holder.
type StaleLock struct {
	File   string
	Holder Holder
}

// Move is a directory's former contents and where they went.
type Move struct{ From, To string }

// Open takes the run's directories for this process and decides its run id:
//
//   - It creates Dir and locks it (Acquire), and CheckpointDir too when it lies outside Dir,
//     so that no second run can use them until Close (or this process's death).
//   - A fresh start (Resume "") in a directory holding checkpoints or a non-empty metrics
//     file is ErrRunExists, unless Overwrite: then everything in the directories but the
//     lock files moves to "<dir>.old-<UTC time>" and the run starts empty. It gets a new
//     run id.
//   - Resume auto keeps the recorded run id (or, in a directory from before run ids, adopts
//     that of its newest checkpoint), so that checkpoint.Latest resumes this run only.
//   - Resume of a named checkpoint continues that checkpoint's run; into a directory that
//     holds another run's data it is an error matching checkpoint.ErrOtherRun, since the
//     two would mix. A checkpoint that cannot be read is left for the resume to report.
//
// On error nothing stays locked. In a job of several processes only the one that writes the
// metrics and commits checkpoints (rank 0) opens the run directory; the others write into it
// under its lock.
func Open(o Options) (*Run, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	now := time.Now
	if o.Now != nil {
		now = o.Now
	}
	r := &Run{}
	dirs := []string{o.Dir}
	if o.CheckpointDir != "" && !within(o.CheckpointDir, o.Dir) {
		dirs = append(dirs, o.CheckpointDir)
	}
	for _, d := range dirs {
		if err := os.MkdirAll(d, 0o755); err != nil {
			r.Close()
			return nil, fmt.Errorf("creating run directory: %w", err)
		}
		l, stale, err := Acquire(d)
		if err != nil {
			r.Close()
			return nil, err
		}
		r.locks = append(r.locks, l)
		if stale != nil {
			r.Stale = append(r.Stale, StaleLock{File: l.Path(), Holder: *stale})
		}
	}
	if err := r.start(o, dirs, now()); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

// start inspects the held directories and records the run id.
func (r *Run) start(o Options, dirs []string, now time.Time) error {
	var steps []int64
	recorded := ""
	if o.CheckpointDir != "" {
		var err error
		if steps, err = checkpoint.List(o.CheckpointDir); err != nil {
			return fmt.Errorf("inspecting the run directory: %w", err)
		}
		if recorded, err = checkpoint.ReadRunID(o.CheckpointDir); err != nil {
			return fmt.Errorf("inspecting the run directory: %w", err)
		}
	}
	metrics := false
	if o.MetricsFile != "" {
		st, err := os.Stat(o.MetricsFile)
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("inspecting the run directory: %w", err)
		}
		metrics = err == nil && st.Size() > 0
	}
	holdsRun := len(steps) > 0 || metrics

	switch o.Resume {
	case "":
		if holdsRun && !o.Overwrite {
			return r.existsError(o, steps, metrics, recorded)
		}
		if o.Overwrite {
			if err := r.moveAside(dirs, now); err != nil {
				return err
			}
		}
		r.ID = checkpoint.NewRunID(now)
	case checkpoint.ResumeAuto:
		r.ID = recorded
		if r.ID == "" {
			r.ID = adoptRunID(o.CheckpointDir, steps, now)
		}
	default:
		ckID, err := checkpoint.RunIDOf(o.Resume)
		switch {
		case err != nil:
			// The resume opens it and reports what is wrong with it, naming the file.
			r.ID = recorded
		case holdsRun && recorded != "" && ckID != "" && ckID != recorded:
			return fmt.Errorf("--resume %s: the checkpoint belongs to run %s, but run directory %s holds run %s; resuming here would mix the two runs (use another --out): %w",
				o.Resume, ckID, o.Dir, recorded, checkpoint.ErrOtherRun)
		case holdsRun && recorded != "":
			r.ID = recorded
		case ckID != "":
			r.ID = ckID // a continuation of that run, in a directory of its own
		default:
			r.ID = recorded
		}
		if r.ID == "" {
			r.ID = checkpoint.NewRunID(now)
		}
	}
	if o.CheckpointDir == "" || r.ID == recorded {
		return nil
	}
	if err := os.MkdirAll(o.CheckpointDir, 0o755); err != nil {
		return fmt.Errorf("creating the checkpoint directory: %w", err)
	}
	if err := checkpoint.WriteRunID(o.CheckpointDir, r.ID); err != nil {
		return fmt.Errorf("recording the run id in %s: %w", o.CheckpointDir, err)
	}
	return nil
}

func (r *Run) existsError(o Options, steps []int64, metrics bool, recorded string) error {
	var what []string
	if len(steps) > 0 {
		what = append(what, fmt.Sprintf("%d checkpoints in %s (newest step %d)", len(steps), o.CheckpointDir, steps[len(steps)-1]))
	}
	if metrics {
		what = append(what, "metrics in "+o.MetricsFile)
	}
	run := ""
	if recorded != "" {
		run = " " + recorded
	}
	return fmt.Errorf("%w: run directory %s already holds run%s (%s): continue it with --resume auto, or pass --overwrite to move it aside to %s.old-<time> and start a new run",
		ErrRunExists, o.Dir, run, strings.Join(what, ", "), filepath.Clean(o.Dir))
}

// adoptRunID is the run id of a directory written before run ids: that of its newest
// checkpoint that records one, else a new one (checkpoints without a run id belong to any).
func adoptRunID(dir string, steps []int64, now time.Time) string {
	for i := len(steps) - 1; i >= 0; i-- {
		if id, err := checkpoint.RunIDOf(filepath.Join(dir, checkpoint.StepDirName(steps[i]))); err == nil && id != "" {
			return id
		}
	}
	return checkpoint.NewRunID(now)
}

// moveAside renames everything in each directory but its lock file into "<dir>.old-<time>",
// a sibling created for it, so that nothing of the old run is lost and the lock stays held.
func (r *Run) moveAside(dirs []string, now time.Time) error {
	for _, d := range dirs {
		entries, err := os.ReadDir(d)
		if err != nil {
			return fmt.Errorf("--overwrite: %w", err)
		}
		var names []string
		for _, e := range entries {
			full := filepath.Join(d, e.Name())
			if e.Name() == LockFile || holdsAny(full, dirs) {
				continue
			}
			names = append(names, e.Name())
		}
		if len(names) == 0 {
			continue
		}
		to, err := claimAside(filepath.Clean(d), now)
		if err != nil {
			return fmt.Errorf("--overwrite: %w", err)
		}
		for _, n := range names {
			if err := os.Rename(filepath.Join(d, n), filepath.Join(to, n)); err != nil {
				return fmt.Errorf("--overwrite: moving the old run aside: %w (what was moved is in %s)", err, to)
			}
		}
		r.MovedAside = append(r.MovedAside, Move{From: d, To: to})
	}
	return nil
}

// claimAside creates an unused "<dir>.old-<time>[-N]".
func claimAside(dir string, now time.Time) (string, error) {
	base := dir + ".old-" + now.UTC().Format("20060102T150405")
	for n := 1; n <= 100; n++ {
		to := base
		if n > 1 {
			to = fmt.Sprintf("%s-%d", base, n)
		}
		err := os.Mkdir(to, 0o755)
		if err == nil {
			return to, nil
		}
		if !errors.Is(err, fs.ErrExist) {
			return "", err
		}
	}
	return "", fmt.Errorf("no free name for %s: %s-2 … -100 all exist", base, base)
}

// holdsAny reports whether path is, or contains, one of dirs (another locked directory,
// which must not move).
func holdsAny(path string, dirs []string) bool {
	for _, d := range dirs {
		if within(d, path) {
			return true
		}
	}
	return false
}

// within reports whether path lies in dir (or is dir), comparing absolute, cleaned paths.
func within(path, dir string) bool {
	p, err1 := filepath.Abs(path)
	d, err2 := filepath.Abs(dir)
	if err1 != nil || err2 != nil {
		return false
	}
	rel, err := filepath.Rel(d, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator))
}

// Close releases the locks. It is safe to call twice.
func (r *Run) Close() error {
	var errs []error
	for _, l := range r.locks {
		errs = append(errs, l.Release())
	}
	r.locks = nil
	return errors.Join(errs...)
}
