package checkpoint

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Names inside a checkpoint directory (dir/step-%08d) and its parent.
const (
	metaFileName = "meta.json"
	metaFormat   = "qvd-checkpoint"
	// metaVersion 2 added the checksum and the run id; version 1 files (no checksum) are
	// still read.
	metaVersion       = 2
	metaVersionLegacy = 1
	// checksumPrefix names the hash of meta.json's checksum field.
	checksumPrefix = "sha256:"

	stepPrefix = "step-"
	tmpPrefix  = ".tmp-step-" // pending checkpoints being written
	oldPrefix  = ".old-step-" // committed checkpoints being replaced or removed

	// writeBufSize: large sequential writes keep the number of syscalls low for multi-GB
	// tensor files without holding much memory per concurrent writer.
	writeBufSize = 1 << 20
)

// Errors callers may test for.
var (
	// ErrNoCheckpoint: a directory holds no checkpoint that verifies.
	ErrNoCheckpoint = errors.New("no valid checkpoint")
	// ErrCorrupt: a checkpoint failed verification. It is returned as a *CorruptError,
	// which names the checkpoint and the file.
	ErrCorrupt = errors.New("checkpoint corrupt")
	// ErrPrune: the checkpoint was committed, but removing old checkpoints (or the copy it
	// replaced) failed. Commit and Save return the new checkpoint's path with it.
	ErrPrune = errors.New("checkpoint committed but removing old checkpoints failed")
)

// StepDirName returns the name of the directory for step's checkpoint, step-%08d.
func StepDirName(step int64) string {
	return fmt.Sprintf("%s%08d", stepPrefix, step)
}

// parseStepDirName is StepDirName's inverse. Only canonical names are accepted, so
// "step-1" or "step-00000001.bak" (a user's copy) are never mistaken for checkpoints, and
// never pruned.
func parseStepDirName(name string) (int64, bool) {
	digits, ok := strings.CutPrefix(name, stepPrefix)
	if !ok || digits == "" || strings.TrimLeft(digits, "0123456789") != "" {
		return 0, false
	}
	step, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || StepDirName(step) != name {
		return 0, false
	}
	return step, true
}

// FileInfo records one file of a checkpoint, as stored in meta.json.
type FileInfo struct {
	Name   string `json:"name"`
	Size   int64  `json:"size"`
	SHA256 string `json:"sha256"` // lowercase hex
}

// Manager saves checkpoints into one directory and prunes old ones.
type Manager struct {
	dir   string
	keep  int
	runID string // the directory's run (RunIDFile) when the Manager was made; "" for none

	// valid caches which checkpoints (by directory name) prune found valid or invalid, so
	// each is verified once per Manager rather than at every commit. The ones this Manager
	// committed are valid: their files were hashed as they were written. Only the committer
	// (one goroutine) prunes, so it needs no lock.
	valid map[string]validity

	// removeAll is os.RemoveAll; tests replace it to make pruning fail.
	removeAll func(string) error
}

// NewManager returns a Manager for dir, creating it if needed. keep <= 0 keeps every
// checkpoint; otherwise each commit removes the checkpoints of this run older than the
// newest keep that verify. The run is the one recorded in dir's RunIDFile, read now: every
// checkpoint the Manager commits carries it.
func NewManager(dir string, keep int) (*Manager, error) {
	if dir == "" {
		return nil, errors.New("checkpoint manager: empty directory")
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("checkpoint manager: create directory: %w", err)
	}
	runID, err := ReadRunID(dir)
	if err != nil {
		return nil, fmt.Errorf("checkpoint manager: %w", err)
	}
	return &Manager{dir: dir, keep: keep, runID: runID, valid: map[string]validity{}, removeAll: os.RemoveAll}, nil
}

// Dir returns the directory the checkpoints are saved in.
func (m *Manager) Dir() string { return m.dir }

// RunID returns the run the Manager's checkpoints belong to ("" when its directory records
// none).
func (m *Manager) RunID() string { return m.runID }

// List returns the steps of the committed checkpoints in the directory, ascending. Pending
// (temporary) directories and names that are not step-%08d are ignored. It does not verify
// the checkpoints; Latest does.
func (m *Manager) List() ([]int64, error) {
	return listSteps(m.dir)
}

func listSteps(dir string) ([]int64, error) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("list checkpoints: %w", err)
	}
	var steps []int64
	for _, e := range entries {
		if step, ok := parseStepDirName(e.Name()); ok && e.IsDir() {
			steps = append(steps, step)
		}
	}
	slices.Sort(steps)
	return steps, nil
}

// Pending is a checkpoint being written into a temporary directory. It becomes visible only
// when Commit renames it into place.
type Pending struct {
	m    *Manager
	step int64
	dir  string

	mu struct {
		sync.Mutex
		files map[string]*FileInfo // nil value: a WriteFile in progress
		done  bool                 // committed or aborted
	}
}

// Begin starts the checkpoint for step by creating its temporary directory.
func (m *Manager) Begin(step int64) (*Pending, error) {
	if step < 0 {
		return nil, fmt.Errorf("begin checkpoint: negative step %d", step)
	}
	// Unique per save: the run, this process and MkdirTemp's random suffix, so that no two
	// saves, of one run or of two, ever share a pending directory.
	tmp, err := os.MkdirTemp(m.dir, fmt.Sprintf("%s%08d-%s%d-", tmpPrefix, step, runPart(m.runID), os.Getpid()))
	if err != nil {
		return nil, fmt.Errorf("begin checkpoint step %d: %w", step, err)
	}
	p := &Pending{m: m, step: step, dir: tmp}
	p.mu.files = make(map[string]*FileInfo)
	return p, nil
}

// Dir returns the temporary directory that files are written into. Other writers (ranks)
// write there with WriteFileIn and report the FileInfo to the committer. It is meaningless
// after Commit or Abort.
func (p *Pending) Dir() string { return p.dir }

// Step returns the step being saved.
func (p *Pending) Step() int64 { return p.step }

// WriteFile creates name in the pending directory and fills it with write, through a
// buffer, hashing while writing, and fsyncs it. name must be a plain file name (no path
// separators, not meta.json) not written before. On error the partial file is removed.
// Calls with distinct names may run concurrently.
func (p *Pending) WriteFile(name string, write func(w io.Writer) error) (FileInfo, error) {
	if err := p.reserve(name); err != nil {
		return FileInfo{}, err
	}
	fi, err := WriteFileIn(p.dir, name, write)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		delete(p.mu.files, name)
		return FileInfo{}, fmt.Errorf("checkpoint step %d: %w", p.step, err)
	}
	p.mu.files[name] = &fi
	return fi, nil
}

func (p *Pending) reserve(name string) error {
	if err := checkFileName(name); err != nil {
		return fmt.Errorf("checkpoint step %d: %w", p.step, err)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.done {
		return fmt.Errorf("checkpoint step %d: write %s: already committed or aborted", p.step, name)
	}
	if _, dup := p.mu.files[name]; dup {
		return fmt.Errorf("checkpoint step %d: write %s: file already written", p.step, name)
	}
	p.mu.files[name] = nil
	return nil
}

// checkFileName accepts the names a checkpoint may record: plain names inside the
// directory, so a corrupt or hostile meta.json cannot make Open read outside it.
func checkFileName(name string) error {
	switch {
	case name == "" || name == "." || name == "..":
		return fmt.Errorf("invalid file name %q", name)
	case strings.ContainsAny(name, `/\`+"\x00"):
		return fmt.Errorf("invalid file name %q: must be a plain name without separators", name)
	case name == metaFileName:
		return fmt.Errorf("invalid file name %q: reserved for the checkpoint's own metadata", name)
	}
	return nil
}

// WriteFileIn is WriteFile for a writer that does not hold the Pending, such as another
// rank writing into the directory the committer announced: it creates dir/name (which must
// not exist), fills it with write through a buffer while hashing, and fsyncs it. The
// returned FileInfo is what the committer passes to Commit as one of others.
func WriteFileIn(dir, name string, write func(w io.Writer) error) (FileInfo, error) {
	if err := checkFileName(name); err != nil {
		return FileInfo{}, err
	}
	return createSynced(dir, name, write)
}

// createSynced is WriteFileIn without the name check, so Commit can write meta.json with it.
func createSynced(dir, name string, write func(w io.Writer) error) (FileInfo, error) {
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
	if err != nil {
		return FileInfo{}, fmt.Errorf("write %s: %w", name, err)
	}
	fi, err := writeSynced(f, name, write)
	if cerr := f.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("write %s: close: %w", name, cerr)
	}
	if err != nil {
		os.Remove(path) // best effort: the pending directory is discarded on failure anyway
		return FileInfo{}, err
	}
	return fi, nil
}

func writeSynced(f *os.File, name string, write func(w io.Writer) error) (FileInfo, error) {
	hw := &hashingWriter{w: f, h: sha256.New()}
	bw := bufio.NewWriterSize(hw, writeBufSize)
	if err := write(bw); err != nil {
		return FileInfo{}, fmt.Errorf("write %s: %w", name, err)
	}
	if err := bw.Flush(); err != nil {
		return FileInfo{}, fmt.Errorf("write %s: %w", name, err)
	}
	if err := f.Sync(); err != nil {
		return FileInfo{}, fmt.Errorf("write %s: fsync: %w", name, err)
	}
	return FileInfo{Name: name, Size: hw.n, SHA256: hex.EncodeToString(hw.h.Sum(nil))}, nil
}

// hashingWriter sits below the buffer so that the hash sees the same large chunks that go
// to the file.
type hashingWriter struct {
	w io.Writer
	h hash.Hash
	n int64
}

func (hw *hashingWriter) Write(b []byte) (int, error) {
	n, err := hw.w.Write(b)
	hw.h.Write(b[:n])
	hw.n += int64(n)
	return n, err
}

// runPart is the run's part of a pending directory's name: "<run id>-", or nothing.
func runPart(runID string) string {
	if runID == "" {
		return ""
	}
	return runID + "-"
}

// metaJSON is the layout of meta.json (see the package documentation).
type metaJSON struct {
	Format  string          `json:"format"`
	Version int             `json:"version"`
	RunID   string          `json:"run_id,omitempty"`
	Step    int64           `json:"step"`
	Created string          `json:"created"`
	Files   []FileInfo      `json:"files"`
	Meta    json.RawMessage `json:"meta"`
	// Checksum is "sha256:" and the hex SHA-256 of the compact JSON encoding of every other
	// field (this one left empty). It is computed over the decoded values, not the file's
	// bytes, so whitespace does not matter but any change of a value does, the caller's
	// metadata included.
	Checksum string `json:"checksum,omitempty"`
}

// checksum computes mj's Checksum over a canonical encoding: encoding/json writes struct
// fields in declaration order, and the caller's metadata is re-encoded with its object keys
// sorted and its numbers as written, so re-formatting meta.json (indentation, key order)
// keeps the checksum while changing any value breaks it.
func (mj metaJSON) checksum() (string, error) {
	mj.Checksum = ""
	if len(mj.Meta) > 0 {
		d := json.NewDecoder(bytes.NewReader(mj.Meta))
		d.UseNumber() // 64-bit seeds and counters keep every digit
		var v any
		if err := d.Decode(&v); err != nil {
			return "", fmt.Errorf("the caller's metadata: %w", err)
		}
		canon, err := json.Marshal(v)
		if err != nil {
			return "", fmt.Errorf("the caller's metadata: %w", err)
		}
		mj.Meta = canon
	}
	b, err := json.Marshal(mj)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return checksumPrefix + hex.EncodeToString(sum[:]), nil
}

// Commit records every file written through WriteFile, plus others (files written into
// Dir() by someone else, with the size and checksum they reported), in meta.json, and
// atomically publishes the checkpoint as <dir>/step-%08d, replacing an existing checkpoint
// of the same step. meta is the caller's metadata, any JSON-marshalable value.
//
// others are checked to exist with the reported size but not re-hashed: their writers
// hashed them while writing, and reading every shard back on the committer would double
// the I/O of a save. Open verifies them like any file. A file in Dir() that is recorded
// neither way is an error, since a checkpoint that silently omits a shard cannot be resumed.
//
// Commit fails without publishing anything unless the error matches ErrPrune, in which
// case the checkpoint was committed, path is valid, and only the clean-up failed. On a
// failure other than ErrPrune the pending directory is left for Abort.
func (p *Pending) Commit(meta any, others ...FileInfo) (path string, err error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.done {
		return "", fmt.Errorf("commit checkpoint step %d: already committed or aborted", p.step)
	}
	files, err := p.recordedFiles(others)
	if err != nil {
		return "", fmt.Errorf("commit checkpoint step %d: %w", p.step, err)
	}
	rawMeta, err := json.Marshal(meta)
	if err != nil {
		return "", fmt.Errorf("commit checkpoint step %d: encode caller metadata: %w", p.step, err)
	}
	mj := metaJSON{
		Format:  metaFormat,
		Version: metaVersion,
		RunID:   p.m.runID,
		Step:    p.step,
		Created: time.Now().UTC().Format(time.RFC3339),
		Files:   files,
		Meta:    rawMeta,
	}
	if mj.Checksum, err = mj.checksum(); err != nil {
		return "", fmt.Errorf("commit checkpoint step %d: checksum meta.json: %w", p.step, err)
	}
	b, err := json.MarshalIndent(mj, "", "  ")
	if err != nil {
		return "", fmt.Errorf("commit checkpoint step %d: encode meta.json: %w", p.step, err)
	}
	b = append(b, '\n')
	if _, err := createSynced(p.dir, metaFileName, func(w io.Writer) error {
		_, err := w.Write(b)
		return err
	}); err != nil {
		if errors.Is(err, os.ErrExist) {
			err = fmt.Errorf("%s already exists in the pending directory: %w", metaFileName, err)
		}
		return "", fmt.Errorf("commit checkpoint step %d: %w", p.step, err)
	}
	// The directory entries of the files must be durable before the rename publishes them.
	if err := syncDir(p.dir); err != nil {
		return "", fmt.Errorf("commit checkpoint step %d: %w", p.step, err)
	}
	path, err = p.m.publish(p.dir, p.step)
	if err != nil {
		return "", fmt.Errorf("commit checkpoint step %d: %w", p.step, err)
	}
	p.mu.done = true
	p.m.valid[StepDirName(p.step)] = valid
	// prune also removes the copy that publish moved aside, if this step replaced one.
	if pruneErr := p.m.prune(p.step); pruneErr != nil {
		return path, fmt.Errorf("%w: %w", ErrPrune, pruneErr)
	}
	return path, nil
}

// recordedFiles merges the files written through WriteFile with others, checks that the
// pending directory holds exactly those files, and returns them sorted by name.
func (p *Pending) recordedFiles(others []FileInfo) ([]FileInfo, error) {
	byName := make(map[string]FileInfo, len(p.mu.files)+len(others))
	for name, fi := range p.mu.files {
		if fi == nil {
			return nil, fmt.Errorf("file %s is still being written", name)
		}
		byName[name] = *fi
	}
	for _, o := range others {
		if err := checkFileName(o.Name); err != nil {
			return nil, err
		}
		if _, dup := byName[o.Name]; dup {
			return nil, fmt.Errorf("file %s recorded twice", o.Name)
		}
		if err := checkSHA256Hex(o.SHA256); err != nil {
			return nil, fmt.Errorf("file %s: %w", o.Name, err)
		}
		st, err := os.Stat(filepath.Join(p.dir, o.Name))
		if err != nil {
			return nil, fmt.Errorf("file %s reported by another writer: %w", o.Name, err)
		}
		if !st.Mode().IsRegular() || st.Size() != o.Size {
			return nil, fmt.Errorf("file %s reported by another writer with size %d, but it is %d bytes on disk", o.Name, o.Size, st.Size())
		}
		byName[o.Name] = o
	}
	entries, err := os.ReadDir(p.dir)
	if err != nil {
		return nil, err
	}
	for _, e := range entries {
		if _, ok := byName[e.Name()]; !ok {
			return nil, fmt.Errorf("%s in the pending directory was not recorded (not written with WriteFile nor passed to Commit)", e.Name())
		}
	}
	names := slices.Sorted(maps.Keys(byName))
	files := make([]FileInfo, len(names))
	for i, n := range names {
		files[i] = byName[n]
	}
	return files, nil
}

func checkSHA256Hex(s string) error {
	if len(s) != 2*sha256.Size || strings.ToLower(s) != s {
		return fmt.Errorf("sha256 %q is not 64 lowercase hex digits", s)
	}
	if _, err := hex.DecodeString(s); err != nil {
		return fmt.Errorf("sha256 %q is not 64 lowercase hex digits", s)
	}
	return nil
}

// publish renames tmp to the step's final name. If that name is taken, the old checkpoint
// is renamed aside first (to .old-step-..., which prune removes once the new one is in
// place), so there is never a moment where step-%08d names a partial directory.
func (m *Manager) publish(tmp string, step int64) (string, error) {
	path := filepath.Join(m.dir, StepDirName(step))
	var aside string
	if _, err := os.Lstat(path); err == nil {
		aside = filepath.Join(m.dir, fmt.Sprintf("%s%08d-%s", oldPrefix, step, randomSuffix()))
		if err := os.Rename(path, aside); err != nil {
			return "", fmt.Errorf("move the existing checkpoint aside: %w", err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	if err := os.Rename(tmp, path); err != nil {
		if aside != "" {
			// Put the old checkpoint back so the step is not lost.
			if rerr := os.Rename(aside, path); rerr != nil {
				err = fmt.Errorf("%w (and restoring the previous checkpoint from %s failed: %v)", err, aside, rerr)
			}
		}
		return "", fmt.Errorf("rename into place: %w", err)
	}
	if err := syncDir(m.dir); err != nil {
		// The rename happened but may not be durable; say so rather than claim success.
		return "", fmt.Errorf("checkpoint renamed to %s but fsync of %s failed: %w", path, m.dir, err)
	}
	return path, nil
}

// validity is what prune knows of a committed checkpoint.
type validity int

const (
	unchecked validity = iota
	valid              // verifies, and belongs to the Manager's run
	corrupt            // fails verification (ErrCorrupt)
	notOurs            // belongs to another run, or cannot be read (an unsupported version, I/O)
)

// prune removes the checkpoints of this run older than the newest keep valid ones (never
// justWritten), leftover .old-step directories, and this run's pending directories of steps
// before justWritten, which can only be leftovers of a crash since the committer writes steps
// in order.
//
// Only valid checkpoints count towards keep: a corrupt one is kept while it is newer than the
// oldest valid one kept (it ages out like the others), so damage never costs a good
// checkpoint. Checkpoints of another run, and ones this build cannot read, are never removed.
func (m *Manager) prune(justWritten int64) error {
	entries, err := os.ReadDir(m.dir)
	if err != nil {
		return fmt.Errorf("list %s: %w", m.dir, err)
	}
	var steps []int64
	var errs []error
	for _, e := range entries {
		name := e.Name()
		full := filepath.Join(m.dir, name)
		if step, ok := parseStepDirName(name); ok && e.IsDir() {
			steps = append(steps, step)
			continue
		}
		if strings.HasPrefix(name, oldPrefix) {
			if err := m.removeAll(full); err != nil {
				errs = append(errs, fmt.Errorf("remove leftover %s: %w", full, err))
			}
			continue
		}
		if step, ok := m.ownPending(name); ok && step < justWritten {
			if err := m.removeAll(full); err != nil {
				errs = append(errs, fmt.Errorf("remove abandoned pending checkpoint %s: %w", full, err))
			}
		}
	}
	if m.keep <= 0 {
		return errors.Join(errs...)
	}
	slices.Sort(steps)
	kept := 0
	for i := len(steps) - 1; i >= 0; i-- {
		step := steps[i]
		if kept < m.keep {
			if m.check(step) == valid {
				kept++
			}
			continue
		}
		if step == justWritten {
			continue
		}
		if v := m.check(step); v == valid || v == corrupt {
			if err := m.removeStep(step); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// check verifies a committed checkpoint for prune, once per Manager.
func (m *Manager) check(step int64) validity {
	name := StepDirName(step)
	if v := m.valid[name]; v != unchecked {
		return v
	}
	v := valid
	c, err := readMeta(filepath.Join(m.dir, name))
	if err == nil && !sameRun(m.runID, c.runID) {
		v = notOurs
	} else if err == nil {
		err = c.verifyFiles()
	}
	switch {
	case errors.Is(err, ErrCorrupt):
		v = corrupt
	case err != nil:
		v = notOurs
	}
	m.valid[name] = v
	return v
}

// sameRun reports whether a checkpoint of run got belongs to the run want. A checkpoint or a
// directory without a run id (written before run ids existed) matches any run.
func sameRun(want, got string) bool {
	return want == "" || got == "" || want == got
}

// ownPending parses the name of a pending directory of the Manager's run: Begin's
// .tmp-step-%08d-<run id>-<pid>-<random> or BeginShared's .tmp-step-%08d-<run id>-shared.
// Without a run id every pending directory counts as the Manager's, as before run ids.
func (m *Manager) ownPending(name string) (int64, bool) {
	rest, ok := strings.CutPrefix(name, tmpPrefix)
	if !ok {
		return 0, false
	}
	digits, rest, _ := strings.Cut(rest, "-")
	step, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || !strings.HasPrefix(rest, runPart(m.runID)) {
		return 0, false
	}
	return step, true
}

// removeStep renames the checkpoint aside before deleting it: a crash during a recursive
// delete would otherwise leave a half-deleted step-%08d directory that looks corrupt.
func (m *Manager) removeStep(step int64) error {
	path := filepath.Join(m.dir, StepDirName(step))
	aside := filepath.Join(m.dir, fmt.Sprintf("%s%08d-%s", oldPrefix, step, randomSuffix()))
	if err := os.Rename(path, aside); err != nil {
		return fmt.Errorf("remove checkpoint %s: %w", path, err)
	}
	delete(m.valid, StepDirName(step))
	if err := m.removeAll(aside); err != nil {
		return fmt.Errorf("remove checkpoint %s: %w", path, err)
	}
	return nil
}

func randomSuffix() string {
	return rand.Text()[:12]
}

// Abort removes the pending directory. It is a no-op after Commit and safe to call twice,
// so `defer p.Abort()` is the idiom.
func (p *Pending) Abort() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.mu.done {
		return nil
	}
	p.mu.done = true
	if err := os.RemoveAll(p.dir); err != nil {
		return fmt.Errorf("abort checkpoint step %d: %w", p.step, err)
	}
	return nil
}

// Save writes a whole checkpoint in one call: Begin, one WriteFile per entry of files (in
// name order, so the output does not depend on map iteration), Commit. On failure nothing
// is published and the pending directory is removed. As with Commit, an error matching
// ErrPrune comes with a valid path.
func (m *Manager) Save(step int64, files map[string]func(io.Writer) error, meta any) (string, error) {
	p, err := m.Begin(step)
	if err != nil {
		return "", err
	}
	defer p.Abort()
	for _, name := range slices.Sorted(maps.Keys(files)) {
		if files[name] == nil {
			return "", fmt.Errorf("checkpoint step %d: write %s: nil write function", step, name)
		}
		if _, err := p.WriteFile(name, files[name]); err != nil {
			return "", err
		}
	}
	return p.Commit(meta)
}

// syncDir fsyncs a directory so that the entries created or renamed in it survive a crash.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("fsync directory: %w", err)
	}
	err = d.Sync()
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("fsync directory %s: %w", dir, err)
	}
	return nil
}

// sharedSuffix ends the name of BeginShared's pending directory.
const sharedSuffix = "shared"

// BeginShared starts a checkpoint whose pending directory is known to every rank of a group
// without being told: <dir>/.tmp-step-NNNNNNNN-<run id>-shared, computed by
// SharedPendingDir from the directory's RunIDFile and the step. Rank 0 calls BeginShared, the
// group synchronises, each rank writes its own files into SharedPendingDir(dir, runID, step)
// with WriteFileIn, and rank 0 commits with their FileInfos (Describe computes them). A
// pending directory left by an earlier attempt of the same run at the same step is removed
// first. The run id keeps two runs' saves apart; within a run, saves are sequential and the
// run directory's lock (package rundir) admits one job at a time.
func (m *Manager) BeginShared(step int64) (*Pending, error) {
	if step < 0 {
		return nil, fmt.Errorf("begin checkpoint: negative step %d", step)
	}
	dir := SharedPendingDir(m.dir, m.runID, step)
	if err := os.RemoveAll(dir); err != nil {
		return nil, fmt.Errorf("begin checkpoint step %d: removing a stale pending directory: %w", step, err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("begin checkpoint step %d: %w", step, err)
	}
	p := &Pending{m: m, step: step, dir: dir}
	p.mu.files = make(map[string]*FileInfo)
	return p, nil
}

// SharedPendingDir is the pending directory of BeginShared(step) under dir for run runID
// (ReadRunID(dir); "" for none).
func SharedPendingDir(dir, runID string, step int64) string {
	return filepath.Join(dir, fmt.Sprintf("%s%08d-%s%s", tmpPrefix, step, runPart(runID), sharedSuffix))
}

// Describe returns the size and SHA-256 of dir/name, for recording a file another process
// wrote into a pending checkpoint.
func Describe(dir, name string) (FileInfo, error) {
	if err := checkFileName(name); err != nil {
		return FileInfo{}, err
	}
	f, err := os.Open(filepath.Join(dir, name))
	if err != nil {
		return FileInfo{}, fmt.Errorf("describe %s: %w", name, err)
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return FileInfo{}, fmt.Errorf("describe %s: %w", name, err)
	}
	return FileInfo{Name: name, Size: n, SHA256: hex.EncodeToString(h.Sum(nil))}, nil
}
