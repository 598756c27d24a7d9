//go:build linux

package shmnet

import (
	"errors"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Futex operations on words in memory shared between processes: without FUTEX_PRIVATE_FLAG,
// which would key the wait on this process's address space and never see the peer's wake.
const (
	futexWaitOp = 0 // FUTEX_WAIT
	futexWakeOp = 1 // FUTEX_WAKE
)

// futexWait sleeps while *w == val, for at most d; it reports whether the sleep timed out.
// A changed value (EAGAIN), a wake or a signal (EINTR) all return false: the caller looks
// again. ts is caller-owned scratch so the hot path does not allocate.
func futexWait(w *atomic.Uint32, val uint32, d time.Duration, ts *unix.Timespec) bool {
	*ts = unix.NsecToTimespec(d.Nanoseconds())
	_, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWaitOp, uintptr(val),
		uintptr(unsafe.Pointer(ts)), 0, 0)
	return errors.Is(e, unix.ETIMEDOUT)
}

// futexWake wakes every sleeper on w (there is at most one per word, but Close must not
// depend on that).
func futexWake(w *atomic.Uint32) {
	_, _, _ = unix.RawSyscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWakeOp, 1<<30, 0, 0, 0)
}
