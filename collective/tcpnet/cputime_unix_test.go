//go:build unix

package tcpnet

import (
	"syscall"
	"time"
)

// cpuTime is the process's user+system CPU time so far: benchmarks report CPU per op, which
// the other engineers' load on a shared machine disturbs far less than wall-clock bandwidth.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
