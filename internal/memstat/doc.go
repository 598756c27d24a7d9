// Package memstat reads the host memory figures the trainer logs with every step: the Go
// heap, everything the Go runtime has mapped, the process's resident set, the memory the
// system (or the process's memory cgroup) still has available and its total, and swap
// traffic.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// Contract:
//   - Reader.Read is cheap enough to call every optimizer step: it reuses its runtime/metrics
//     sample slice, keeps the /proc files open and rereads them with pread into buffers it
//     owns, and parses them by hand. After the first call it does not allocate.
//   - Figures that cannot be read (not Linux, /proc not mounted, a field missing from an old
//     kernel) are zero. Read never returns an error and never logs: a missing figure is not
//     worth interrupting a training run for, and zero is documented as "unknown" (except
//     Available with LimitedBy LimitCgroup: then 0 means the cgroup has nothing left).
//   - Available is what this process can still have: the smaller of the machine's
//     MemAvailable and, when its memory cgroup (v2, or v1) or an ancestor has a limit, that
//     limit less the cgroup's working set (usage less inactive file pages). Inside docker
//     --memory or a SLURM job's cgroup the cgroup's figure is the one that binds;
//     Snapshot.LimitedBy says which applies, and the host's and the cgroup's own figures,
//     with the cgroup's cumulative OOM-kill count, are reported beside it. The cgroup is
//     found once, on the first Read, from /proc/self/cgroup and /proc/self/mountinfo.
//   - A Reader is safe for concurrent use; its methods serialise on a mutex. Close releases
//     the open /proc and cgroup files and is safe to call twice; Read after Close reports
//     only the Go runtime's figures.
package memstat
