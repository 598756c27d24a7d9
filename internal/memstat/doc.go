// Package memstat reads the host memory figures the trainer logs with every step: the Go
// heap, everything the Go runtime has mapped, the process's resident set, the memory the
// system still has available and its total, and swap traffic.
//
// Contract:
//   - Reader.Read is cheap enough to call every optimizer step: it reuses its runtime/metrics
//     sample slice, keeps the /proc files open and rereads them with pread into buffers it
//     owns, and parses them by hand. After the first call it does not allocate.
//   - Figures that cannot be read (not Linux, /proc not mounted, a field missing from an old
//     kernel) are zero. Read never returns an error and never logs: a missing figure is not
//     worth interrupting a training run for, and zero is documented as "unknown".
//   - Available is the kernel's MemAvailable for the whole machine; inside a container with a
//     memory limit the cgroup's own limit can be lower, and this package does not read it.
//   - A Reader is safe for concurrent use; its methods serialise on a mutex. Close releases
//     the open /proc files and is safe to call twice; Read after Close reports only the Go
//     runtime's figures.
package memstat
