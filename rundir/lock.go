package rundir

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// LockFile is the name of the lock file in a locked directory.
const LockFile = ".qvd.lock"

// ErrLocked: the directory is held by another run. It is returned as a *LockedError.
var ErrLocked = errors.New("run directory is in use")

// Holder is the process that holds (or held) a lock, as recorded in the lock file.
type Holder struct {
	PID   int       `json:"pid"`
	Host  string    `json:"host"`
	Since time.Time `json:"since"`
}

func (h Holder) String() string {
	if h.PID == 0 {
		return "a process that has not recorded itself yet"
	}
	return fmt.Sprintf("pid %d on host %s since %s", h.PID, h.Host, h.Since.Format(time.RFC3339))
}

// LockedError names the run that holds a directory.
type LockedError struct {
	Dir    string
	File   string // the lock file
	Holder Holder
	Reason string // why a lock that flock did not hold is still considered held; "" if it was
}

func (e *LockedError) Error() string {
	msg := fmt.Sprintf("run directory %s is in use by another qvd run: %s (lock file %s)", e.Dir, e.Holder, e.File)
	if e.Reason != "" {
		msg += ": " + e.Reason
	}
	return msg
}

// Is makes errors.Is(err, ErrLocked) true.
func (e *LockedError) Is(target error) bool { return target == ErrLocked }

// Lock is an exclusive hold on a directory: flock(2) on its LockFile, which also records the
// holder (pid, host, since) for the error a second run gets and for telling a lock left by a
// dead process. The kernel drops a flock when its process dies however it dies, so a crash
// never leaves the directory held; the record it leaves behind is noted as stale.
type Lock struct {
	f    *os.File
	path string
}

// self describes this process.
func self(now time.Time) Holder {
	host, _ := os.Hostname()
	return Holder{PID: os.Getpid(), Host: host, Since: now.UTC().Truncate(time.Second)}
}

// Acquire locks dir (which must exist) for this process. A directory held by a live process
// is an error matching ErrLocked that names the holder. If the lock file records a holder that
// is gone — a process of this host, whose flock the kernel has released (or, on a filesystem
// without flock, whose pid no longer runs) — the lock is taken over and that holder returned
// as stale, for the caller to note. A record of a process on another host,
// which cannot be checked from here, is honoured: the error says to remove the lock file if
// that run has ended.
func Acquire(dir string) (l *Lock, stale *Holder, err error) {
	return acquire(dir, self(time.Now()), processAlive, flockNB)
}

// flockNB takes fd's exclusive flock without waiting.
func flockNB(fd int) error { return syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB) }

func acquire(dir string, me Holder, alive func(pid int) bool, flock func(fd int) error) (*Lock, *Holder, error) {
	path := filepath.Join(dir, LockFile)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, nil, fmt.Errorf("lock run directory: %w", err)
	}
	fail := func(err error) (*Lock, *Holder, error) {
		f.Close() // drops the flock, if taken
		return nil, nil, err
	}
	flockErr := flock(int(f.Fd()))
	flocked := flockErr == nil
	prev, readErr := readHolder(f)
	switch {
	case errors.Is(flockErr, syscall.EWOULDBLOCK):
		return fail(&LockedError{Dir: dir, File: path, Holder: prev})
	case errors.Is(flockErr, syscall.ENOLCK), errors.Is(flockErr, syscall.EOPNOTSUPP), errors.Is(flockErr, syscall.ENOSYS):
		// A filesystem without flock: the record alone decides, below (two runs starting in
		// the same instant could both pass; nothing better is portable).
	case flockErr != nil:
		return fail(fmt.Errorf("lock run directory: flock %s: %w", path, flockErr))
	}
	if readErr != nil {
		return fail(fmt.Errorf("lock run directory: read %s: %w", path, readErr))
	}
	var stale *Holder
	if prev.PID != 0 {
		switch {
		case flocked && prev.Host == me.Host:
			// This kernel gave us the flock, so no process of this host holds it: whatever
			// runs under the recorded pid now (pids are reused) is not that run.
		case prev.Host != me.Host:
			return fail(&LockedError{Dir: dir, File: path, Holder: prev,
				Reason: "a process on another host cannot be checked from here; if that run has ended, remove the lock file"})
		case prev.PID != me.PID && alive(prev.PID):
			// A filesystem without flock: the record names a running process, and a wrong
			// guess would let two runs share the directory.
			return fail(&LockedError{Dir: dir, File: path, Holder: prev,
				Reason: fmt.Sprintf("pid %d is running; if it is not a qvd run (its pid was reused), remove the lock file", prev.PID)})
		}
		stale = &prev
	}
	b, err := json.Marshal(me)
	if err == nil {
		err = f.Truncate(0)
	}
	if err == nil {
		_, err = f.WriteAt(append(b, '\n'), 0)
	}
	if err == nil {
		err = f.Sync()
	}
	if err != nil {
		return fail(fmt.Errorf("lock run directory: record the holder in %s: %w", path, err))
	}
	return &Lock{f: f, path: path}, stale, nil
}

// readHolder returns the recorded holder, or a zero Holder when the file is empty (released,
// or being written by a holder that has just taken the flock). A record that does not parse
// is treated as empty: it can only be the leftover of a crash mid-write.
func readHolder(f *os.File) (Holder, error) {
	b, err := io.ReadAll(io.NewSectionReader(f, 0, 1<<16))
	if err != nil {
		return Holder{}, err
	}
	var h Holder
	if len(b) == 0 || json.Unmarshal(b, &h) != nil || h.PID <= 0 {
		return Holder{}, nil
	}
	return h, nil
}

// processAlive reports whether a process with pid exists on this host.
func processAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// Path returns the lock file.
func (l *Lock) Path() string { return l.path }

// Release clears the record and drops the lock. It is safe to call twice.
func (l *Lock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Truncate(0)
	if cerr := l.f.Close(); err == nil {
		err = cerr
	}
	l.f = nil
	if err != nil {
		return fmt.Errorf("release %s: %w", l.path, err)
	}
	return nil
}
