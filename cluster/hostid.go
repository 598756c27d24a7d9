package cluster

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
)

// HostIDLen is the length of the string HostID returns (hex digits).
const HostIDLen = 16

// ErrNoHostID: this process cannot tell which other processes it can share memory with
// (no Linux /proc, or no /dev/shm). Callers treat the process as alone on its host.
var ErrNoHostID = errors.New("cluster: cannot identify the shared-memory domain")

// hostSources are the facts that decide whether two processes can share memory. Each one
// alone is not enough:
//
//   - BootID (/proc/sys/kernel/random/boot_id) names one kernel run: two machines, or one
//     machine before and after a reboot, never share memory. The hostname is no substitute:
//     containers and cloud VMs repeat hostnames, and a container can set any it likes.
//   - IPC is the IPC namespace (readlink /proc/self/ns/ipc, "ipc:[4026531839]"). System V
//     and POSIX shared memory are scoped to it: containers share it only when started with
//     `ipc: shareable` / `ipc: container:…` (or `host`). It is the IPC namespace rather than
//     the network namespace that matters: containers on one network namespace (a Kubernetes
//     pod) may still be unable to share memory, and ones with --net=host may share none.
//     Namespace inode numbers are only unique within one boot, hence BootID beside it.
//   - ShmDev and ShmIno identify the /dev/shm directory (stat's device and inode), where
//     POSIX shm_open segments live. /dev/shm is a mount: two containers in one IPC namespace
//     but each with its own tmpfs at /dev/shm cannot open each other's segments, while a
//     bind mount of the same tmpfs gives the same device and inode.
type hostSources struct {
	BootID string
	IPC    string
	ShmDev uint64
	ShmIno uint64
}

// id hashes the sources into HostIDLen hex digits: short enough for gossip metadata, and a
// 64-bit hash makes a collision among a cluster's hosts negligible.
func (s hostSources) id() string {
	h := sha256.New()
	fmt.Fprintf(h, "qvd-host-v1\x00%s\x00%s\x00%d:%d", s.BootID, s.IPC, s.ShmDev, s.ShmIno)
	return hex.EncodeToString(h.Sum(nil))[:HostIDLen]
}

// HostID identifies the set of processes that can share memory with this one: processes
// with equal HostIDs can use a shared-memory transport between them. It is derived from the
// kernel boot id, the IPC namespace and the identity of /dev/shm (see hostSources), never
// from the hostname. It is stable for the life of the process and the same for every process
// in the same kernel, IPC namespace and /dev/shm mount. Without Linux /proc or /dev/shm it
// fails with ErrNoHostID.
func HostID() (string, error) {
	s, err := readHostSources("/proc", "/dev/shm")
	if err != nil {
		return "", err
	}
	return s.id(), nil
}

// readHostSources reads the sources from a proc file system mounted at proc and the shm
// directory shm.
func readHostSources(proc, shm string) (hostSources, error) {
	var s hostSources
	b, err := os.ReadFile(proc + "/sys/kernel/random/boot_id")
	if err != nil {
		return s, fmt.Errorf("%w: boot id: %w", ErrNoHostID, err)
	}
	if s.BootID = strings.TrimSpace(string(b)); s.BootID == "" {
		return s, fmt.Errorf("%w: empty boot id in %s", ErrNoHostID, proc)
	}
	if s.IPC, err = os.Readlink(proc + "/self/ns/ipc"); err != nil {
		return s, fmt.Errorf("%w: IPC namespace: %w", ErrNoHostID, err)
	}
	fi, err := os.Stat(shm)
	if err != nil {
		return s, fmt.Errorf("%w: %w", ErrNoHostID, err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || !fi.IsDir() {
		return s, fmt.Errorf("%w: %s is not a directory with a device and inode", ErrNoHostID, shm)
	}
	s.ShmDev, s.ShmIno = uint64(st.Dev), uint64(st.Ino)
	return s, nil
}
