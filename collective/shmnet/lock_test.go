//go:build linux

package shmnet

import (
	"os"
	"path/filepath"
	"testing"
)

// TestLockSurvivesUnlink: the owner's flock is seen through a peer's own descriptor (another
// open file description) after the file has lost its name, and is gone as soon as the
// owner's descriptor closes. This is what liveness rests on once New has unlinked the
// segments (the cross-process, cross-namespace case is TestPidNamespaces).
func TestLockSurvivesUnlink(t *testing.T) {
	path := filepath.Join(t.TempDir(), "seg")
	owner, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer owner.Close()
	if err := lockOwner(int(owner.Fd())); err != nil {
		t.Fatal(err)
	}
	peer, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	for i := range 3 { // probing repeatedly must not disturb the owner's lock
		if gone, err := ownerGone(int(peer.Fd())); err != nil || gone {
			t.Fatalf("probe %d with the owner's descriptor open: gone=%v err=%v", i, gone, err)
		}
	}
	if stale, err := tryLockStale(int(peer.Fd())); err != nil || stale {
		t.Fatalf("exclusive lock with the owner's descriptor open: granted=%v err=%v", stale, err)
	}
	_ = owner.Close()
	if gone, err := ownerGone(int(peer.Fd())); err != nil || !gone {
		t.Fatalf("probe after the owner's descriptor closed: gone=%v err=%v", gone, err)
	}
}
