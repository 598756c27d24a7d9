//go:build linux

package shmnet

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// Liveness. A rank's transport holds flock(LOCK_EX) on its own segment file from creation
// to Close, through a descriptor it keeps open; each peer keeps a descriptor of that file
// too, opened before the file was unlinked. A flock lock belongs to the open file
// description, not to a pid: the kernel drops it when the owner's last descriptor of that
// description closes, however the process ends, and it means the same thing in every pid
// namespace and whatever the pid is reused for later. So a peer asking for LOCK_SH without
// blocking learns whether the creator is still there (EWOULDBLOCK) or gone (granted), and the
// sweep asking for LOCK_EX learns whether a named file still has a live creator. Pids are
// kept for messages only.

// lockOwner takes the creator's exclusive lock on its own segment. It blocks, but only
// ever behind a sweep that locked the file in the instant between its creation and this
// call (createSegment then finds the name gone and starts again).
func lockOwner(fd int) error {
	for {
		err := unix.Flock(fd, unix.LOCK_EX)
		if !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

// ownerGone reports whether the creator of the segment open at fd has released its lock:
// its process exited (or closed its transport). A granted probe is released at once, so
// probes from several links, and from several peers, never get in one another's way.
func ownerGone(fd int) (bool, error) {
	for {
		err := unix.Flock(fd, unix.LOCK_SH|unix.LOCK_NB)
		switch {
		case err == nil:
			_ = unix.Flock(fd, unix.LOCK_UN)
			return true, nil
		case errors.Is(err, unix.EWOULDBLOCK):
			return false, nil
		case errors.Is(err, unix.EINTR):
			continue
		}
		return false, fmt.Errorf("flock: %w", err)
	}
}

// tryLockStale takes the exclusive lock on a named segment without blocking; it reports
// whether the lock was granted, that is whether no live process holds the file. The lock is
// held until fd closes.
func tryLockStale(fd int) (bool, error) {
	for {
		err := unix.Flock(fd, unix.LOCK_EX|unix.LOCK_NB)
		switch {
		case err == nil:
			return true, nil
		case errors.Is(err, unix.EWOULDBLOCK):
			return false, nil
		case errors.Is(err, unix.EINTR):
			continue
		}
		return false, fmt.Errorf("flock: %w", err)
	}
}

// sameFile reports whether path still names the file open at fd (the sweep may have
// removed a name in the instant before its creator locked it).
func sameFile(fd int, path string) (bool, error) {
	var a, b unix.Stat_t
	if err := unix.Fstat(fd, &a); err != nil {
		return false, err
	}
	if err := unix.Lstat(path, &b); err != nil {
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		return false, err
	}
	return a.Dev == b.Dev && a.Ino == b.Ino, nil
}
