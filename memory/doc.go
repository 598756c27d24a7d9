// Package memory is qvd's one place for memory: it watches what a training process uses and
// says when it runs short, holds the accounting of a rank's training state (States, which
// zero measures and estimates), the memory limit check, and ErrOutOfMemory, the error every
// engine backend wraps. It is a leaf of docs/architecture.md: it must not import any qvd
// package outside internal/, so that the engines, zero and the trainer can all import it.
//
// A Monitor takes one sample per optimizer step (Observe) and reports:
//   - host: the Go heap in use, the process's resident set, the memory the system still has
//     available, and the swap-in/swap-out rates (pages per second from /proc/vmstat, between
//     two samples);
//   - devices: used/free/total per GPU through NVML, or why there are none ("no GPU: NVML not
//     found"), read only when a report is to be logged, never on every step;
//   - qvd's own accounting: the bytes the trainer holds by category (parameters, gradients,
//     master weights, optimizer state, buffers), current and the largest seen;
//   - per-phase peaks: Begin/End around forward+backward, communication and the optimizer
//     step sample the Go heap when the phase ends.
//
// What "peak" means: Go's heap is garbage-collected, so its size rises with garbage and falls
// at each collection. A peak here is the largest of the samples taken (one per phase end and
// one per step), not the true high-water mark between samples; garbage not yet collected
// counts. For qvd's CPU engine the model states are allocated once, so the peaks mostly show
// what the graph and the collectives add on top of them.
//
// Pressure says whether the host is running short: available memory below
// memory.min_available, pages swapped in or out since the previous sample, or a process
// OOM-killed under the memory cgroup's limit since then. Available memory is the smaller of
// the machine's MemAvailable and the memory cgroup's limit less its working set (docker
// --memory, a SLURM job), and a percentage min_available is of the smaller of MemTotal and
// that limit (see internal/memstat); Report.LimitLine says which applies. The monitor only
// reports it; the caller decides what to do (warn, shrink the micro-batch).
//
// Measure (and Monitor.Measure) is a scoped measure, the memory guides' MemoryMonitor context
// manager: the change in heap and RSS, and the bytes allocated, across one operation.
//
// Contract: a Monitor is safe for concurrent use (its methods serialise on a mutex); methods
// on a nil *Monitor do nothing, so a caller can leave monitoring off without branches. The
// package reads no flags or environment and never exits; the caller logs what it returns.
// Close releases the host files and NVML and is safe to call twice.
package memory
