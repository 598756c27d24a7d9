package checkpoint

import (
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
	"time"
)

// CorruptError reports a checkpoint that failed verification. It matches ErrCorrupt with
// errors.Is; Err, when set, is the underlying error (for example a missing file).
type CorruptError struct {
	Path   string // the checkpoint directory
	File   string // the file that failed, e.g. "model.safetensors" or "meta.json"
	Reason string
	Err    error
}

func (e *CorruptError) Error() string {
	msg := fmt.Sprintf("checkpoint %s: %s: %s", e.Path, e.File, e.Reason)
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Is makes errors.Is(err, ErrCorrupt) true.
func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }

func (e *CorruptError) Unwrap() error { return e.Err }

// Checkpoint is a committed checkpoint whose files were verified when it was opened.
type Checkpoint struct {
	path    string
	runID   string
	step    int64
	created time.Time
	files   []FileInfo
	meta    json.RawMessage
}

// Open reads path/meta.json, checks its checksum, and verifies every file it lists:
// existence, size and SHA-256. Any mismatch, a missing or unparsable meta.json, a meta.json
// whose checksum does not match its content (edited or damaged), or one that is not a
// qvd-checkpoint is an error matching ErrCorrupt that names the file. A meta.json of a
// newer, unknown version is a plain error, not ErrCorrupt: the checkpoint may be fine, this
// build just cannot read it, so Latest must not silently fall back past it.
//
// Verification reads every file once, which for a large model costs seconds; it is done
// here, before anything is restored, so that a resume never starts from damaged state.
func Open(path string) (*Checkpoint, error) {
	c, err := readMeta(path)
	if err != nil {
		return nil, err
	}
	if err := c.verifyFiles(); err != nil {
		return nil, err
	}
	return c, nil
}

// verifyFiles checks every recorded file against meta.json.
func (c *Checkpoint) verifyFiles() error {
	for _, fi := range c.files {
		if err := verifyFile(c.path, fi); err != nil {
			return err
		}
	}
	return nil
}

func readMeta(path string) (*Checkpoint, error) {
	corrupt := func(reason string, err error) error {
		return &CorruptError{Path: path, File: metaFileName, Reason: reason, Err: err}
	}
	b, err := os.ReadFile(filepath.Join(path, metaFileName))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			if _, serr := os.Stat(path); serr != nil {
				return nil, fmt.Errorf("open checkpoint: %w", serr) // no checkpoint at all, not a damaged one
			}
			return nil, corrupt("missing (checkpoint was not committed by qvd or was damaged)", nil)
		}
		return nil, fmt.Errorf("open checkpoint %s: %w", path, err)
	}
	var mj metaJSON
	if err := json.Unmarshal(b, &mj); err != nil {
		return nil, corrupt("invalid JSON", err)
	}
	if mj.Format != metaFormat {
		return nil, corrupt(fmt.Sprintf("format %q, want %q", mj.Format, metaFormat), nil)
	}
	if mj.Version != metaVersion && mj.Version != metaVersionLegacy {
		return nil, fmt.Errorf("open checkpoint %s: meta.json version %d is not supported by this build (it reads versions %d and %d); use a newer qvd",
			path, mj.Version, metaVersionLegacy, metaVersion)
	}
	// The checksum is checked before anything else is believed: a meta.json edited by hand
	// or damaged on disk must not steer a resume (a changed step or data position would
	// continue silently from the wrong place). Version 1 predates it; a version 1 file that
	// has one is checked all the same.
	switch want, err := mj.checksum(); {
	case err != nil:
		return nil, corrupt("cannot compute the checksum", err)
	case mj.Checksum == "" && mj.Version != metaVersionLegacy:
		return nil, corrupt("no checksum (every qvd-checkpoint meta.json of version 2 has one)", nil)
	case mj.Checksum != "" && mj.Checksum != want:
		return nil, corrupt("checksum mismatch (meta.json was edited or damaged after it was written)", nil)
	}
	if mj.RunID != "" {
		if err := checkRunID(mj.RunID); err != nil {
			return nil, corrupt("run_id", err)
		}
	}
	if mj.Step < 0 {
		return nil, corrupt(fmt.Sprintf("negative step %d", mj.Step), nil)
	}
	// A checkpoint copied under another name (to keep the best one, say) is fine, but a
	// step-%08d directory whose meta.json disagrees with its name was tampered with.
	if step, ok := parseStepDirName(filepath.Base(path)); ok && step != mj.Step {
		return nil, corrupt(fmt.Sprintf("records step %d but the directory is named for step %d", mj.Step, step), nil)
	}
	created, err := time.Parse(time.RFC3339, mj.Created)
	if err != nil {
		return nil, corrupt("invalid created time", err)
	}
	seen := make(map[string]bool, len(mj.Files))
	for _, fi := range mj.Files {
		if err := checkFileName(fi.Name); err != nil {
			return nil, corrupt("files", err)
		}
		if seen[fi.Name] {
			return nil, corrupt(fmt.Sprintf("files: %s listed twice", fi.Name), nil)
		}
		seen[fi.Name] = true
		if fi.Size < 0 {
			return nil, corrupt(fmt.Sprintf("files: %s has negative size %d", fi.Name, fi.Size), nil)
		}
		if err := checkSHA256Hex(fi.SHA256); err != nil {
			return nil, corrupt("files: "+fi.Name, err)
		}
	}
	if len(mj.Meta) == 0 {
		mj.Meta = json.RawMessage("null")
	}
	return &Checkpoint{path: path, runID: mj.RunID, step: mj.Step, created: created, files: mj.Files, meta: mj.Meta}, nil
}

// verifyFile checks one recorded file's size, then its hash. The size is checked first so
// that the common damage, a truncated file, is reported without reading it.
func verifyFile(dir string, fi FileInfo) error {
	corrupt := func(reason string, err error) error {
		return &CorruptError{Path: dir, File: fi.Name, Reason: reason, Err: err}
	}
	f, err := os.Open(filepath.Join(dir, fi.Name))
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			return corrupt("file missing", nil)
		}
		return fmt.Errorf("verify checkpoint %s: %w", dir, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("verify checkpoint %s: %w", dir, err)
	}
	if !st.Mode().IsRegular() {
		return corrupt("not a regular file", nil)
	}
	if st.Size() != fi.Size {
		return corrupt(fmt.Sprintf("size %d, want %d (file truncated or modified)", st.Size(), fi.Size), nil)
	}
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return fmt.Errorf("verify checkpoint %s: read %s: %w", dir, fi.Name, err)
	}
	if n != fi.Size || hex.EncodeToString(h.Sum(nil)) != fi.SHA256 {
		return corrupt("sha256 mismatch (file truncated or modified)", nil)
	}
	return nil
}

// Path returns the checkpoint's directory.
func (c *Checkpoint) Path() string { return c.path }

// RunID returns the run the checkpoint belongs to ("" if it was written before run ids).
func (c *Checkpoint) RunID() string { return c.runID }

// Step returns the optimizer step the checkpoint was saved at.
func (c *Checkpoint) Step() int64 { return c.step }

// Created returns when the checkpoint was committed (to the second).
func (c *Checkpoint) Created() time.Time { return c.created }

// Files returns the recorded files, sorted by name.
func (c *Checkpoint) Files() []FileInfo { return slices.Clone(c.files) }

// Meta decodes the caller's metadata (the "meta" value of meta.json) into v.
func (c *Checkpoint) Meta(v any) error {
	if err := json.Unmarshal(c.meta, v); err != nil {
		return fmt.Errorf("checkpoint %s: decode metadata: %w", c.path, err)
	}
	return nil
}

func (c *Checkpoint) file(name string) (FileInfo, error) {
	for _, fi := range c.files {
		if fi.Name == name {
			return fi, nil
		}
	}
	names := make([]string, len(c.files))
	for i, fi := range c.files {
		names[i] = fi.Name
	}
	return FileInfo{}, fmt.Errorf("checkpoint %s: no file %q recorded (it has %v): %w", c.path, name, names, fs.ErrNotExist)
}

// FilePath returns the path of a recorded file. A name the checkpoint does not record is an
// error matching fs.ErrNotExist.
func (c *Checkpoint) FilePath(name string) (string, error) {
	if _, err := c.file(name); err != nil {
		return "", err
	}
	return filepath.Join(c.path, name), nil
}

// Safetensors reads and parses a recorded safetensors file. The bytes are checked against
// the recorded SHA-256 again as they are read (the file may have changed since Open, and
// hashing bytes already in memory is cheap next to parsing them).
func (c *Checkpoint) Safetensors(name string) (*File, error) {
	fi, err := c.file(name)
	if err != nil {
		return nil, err
	}
	path := filepath.Join(c.path, name)
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", c.path, err)
	}
	sum := sha256.Sum256(b)
	if int64(len(b)) != fi.Size || hex.EncodeToString(sum[:]) != fi.SHA256 {
		return nil, &CorruptError{Path: c.path, File: name, Reason: "changed since the checkpoint was opened (sha256 mismatch)"}
	}
	f, err := ParseSafetensors(b)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %s: %w", c.path, name, err)
	}
	return f, nil
}

// Latest returns the newest checkpoint in dir that verifies and belongs to dir's run (the
// RunIDFile; checkpoints without a run id, and every checkpoint of a directory that records
// no run, qualify). A checkpoint that fails verification (ErrCorrupt) or belongs to another
// run (ErrOtherRun) is skipped in favour of the previous one, and the reason is appended to
// skipped so the caller can log it. Any other error (unreadable directory,
// permission denied, a meta.json version this build cannot read) stops the search and is
// returned, because falling back past a good checkpoint would silently lose progress.
// A directory that does not exist or holds no checkpoint that verifies gives an error
// matching ErrNoCheckpoint (with skipped listing any corrupt ones).
func Latest(dir string) (c *Checkpoint, skipped []error, err error) {
	if dir == "" {
		// Not ErrNoCheckpoint: the caller would start a fresh run over an unset path.
		return nil, nil, errors.New("find latest checkpoint: empty directory")
	}
	steps, err := listSteps(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, fmt.Errorf("%w in %s (directory does not exist)", ErrNoCheckpoint, dir)
	}
	if err != nil {
		return nil, nil, err
	}
	runID, err := ReadRunID(dir)
	if err != nil {
		return nil, nil, fmt.Errorf("find latest checkpoint: %w", err)
	}
	for i := len(steps) - 1; i >= 0; i-- {
		path := filepath.Join(dir, StepDirName(steps[i]))
		// The run is checked from meta.json before the files are read: another run's
		// checkpoint is skipped without hashing it.
		c, err := readMeta(path)
		if err == nil && !sameRun(runID, c.runID) {
			err = &OtherRunError{Path: path, RunID: c.runID, Want: runID}
		} else if err == nil {
			err = c.verifyFiles()
		}
		if err == nil {
			return c, skipped, nil
		}
		if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrOtherRun) {
			return nil, skipped, err
		}
		skipped = append(skipped, err)
	}
	if len(skipped) > 0 {
		return nil, skipped, fmt.Errorf("%w in %s (%d checkpoints skipped: corrupt or of another run)", ErrNoCheckpoint, dir, len(skipped))
	}
	return nil, nil, fmt.Errorf("%w in %s", ErrNoCheckpoint, dir)
}

// ResumeAuto is the --resume value that picks the newest valid checkpoint.
const ResumeAuto = "auto"

// Resolve implements the trainer's --resume flag. "auto" is Latest(dir); its
// ErrNoCheckpoint is passed through so the caller can start fresh. Anything else is the
// path of a checkpoint directory, opened with Open and without fallback: a checkpoint the
// user named that does not verify is an error.
func Resolve(spec, dir string) (*Checkpoint, []error, error) {
	switch spec {
	case ResumeAuto:
		return Latest(dir)
	case "":
		return nil, nil, errors.New(`resolve checkpoint: empty --resume value (want "auto" or a checkpoint directory)`)
	}
	c, err := Open(spec) // its errors already name the checkpoint
	if err != nil {
		return nil, nil, err
	}
	return c, nil, nil
}
