package checkpoint

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// RunIDFile names the file in a checkpoint directory that records which run its checkpoints
// belong to. It holds the run id and a newline. The run directory's owner (package rundir)
// writes it when a run starts; a Manager stamps the id into every meta.json it commits, and
// Latest only returns checkpoints of that run.
const RunIDFile = "run-id"

// maxRunIDLen bounds a run id: it becomes part of pending directory names.
const maxRunIDLen = 64

// ErrOtherRun: a checkpoint belongs to another run than the directory's. Latest reports such
// checkpoints in its skipped list as *OtherRunError, which matches it.
var ErrOtherRun = errors.New("checkpoint belongs to another run")

// OtherRunError names a checkpoint of another run found in a run's checkpoint directory.
type OtherRunError struct {
	Path  string // the checkpoint
	RunID string // the run it belongs to
	Want  string // the directory's run
}

func (e *OtherRunError) Error() string {
	return fmt.Sprintf("checkpoint %s belongs to run %s, not to this directory's run %s (recorded in %s)",
		e.Path, e.RunID, e.Want, RunIDFile)
}

// Is makes errors.Is(err, ErrOtherRun) true.
func (e *OtherRunError) Is(target error) bool { return target == ErrOtherRun }

// NewRunID returns a fresh run id: the start time (UTC, to the second), so that people can
// tell runs apart at a glance, and 32 random bits, so that two runs started in the same
// second differ. Example: 20261124T101500-3f9a2c1b.
func NewRunID(now time.Time) string {
	var b [4]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return now.UTC().Format("20060102T150405") + "-" + hex.EncodeToString(b[:])
}

// checkRunID accepts the ids NewRunID makes and anything similar: they end up in file names.
func checkRunID(id string) error {
	if id == "" || len(id) > maxRunIDLen {
		return fmt.Errorf("run id %q: must be 1 to %d characters", id, maxRunIDLen)
	}
	if strings.Trim(id, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.") != "" || id[0] == '.' || id[0] == '-' {
		return fmt.Errorf("run id %q: only letters, digits, '-', '_' and '.' (not first) are allowed", id)
	}
	return nil
}

// ReadRunID returns the run id recorded in dir, or "" when dir records none (a directory
// written by a qvd without run ids, or by a caller that does not use them).
func ReadRunID(dir string) (string, error) {
	b, err := os.ReadFile(filepath.Join(dir, RunIDFile))
	if errors.Is(err, fs.ErrNotExist) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("read the run id: %w", err)
	}
	id := strings.TrimSpace(string(b))
	if err := checkRunID(id); err != nil {
		return "", fmt.Errorf("%s: %w", filepath.Join(dir, RunIDFile), err)
	}
	return id, nil
}

// WriteRunID records id as the run of dir's checkpoints, atomically (a reader sees the old
// id or the new one) and durably. Only the run directory's owner, holding its lock, calls it.
func WriteRunID(dir, id string) error {
	if err := checkRunID(id); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+RunIDFile+"-*")
	if err != nil {
		return fmt.Errorf("write the run id: %w", err)
	}
	_, err = tmp.WriteString(id + "\n")
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), filepath.Join(dir, RunIDFile))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("write the run id: %w", err)
	}
	return syncDir(dir)
}

// RunIDOf returns the run id recorded in the meta.json of the checkpoint at path ("" for a
// checkpoint written before run ids existed). It checks meta.json (its checksum included) but
// not the other files, so it is cheap; errors are Open's.
func RunIDOf(path string) (string, error) {
	c, err := readMeta(path)
	if err != nil {
		return "", err
	}
	return c.runID, nil
}

// List returns the steps of the committed checkpoints in dir, ascending, like Manager.List;
// a directory that does not exist holds none.
func List(dir string) ([]int64, error) {
	steps, err := listSteps(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	return steps, err
}
