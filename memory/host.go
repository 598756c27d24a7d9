package memory

import (
	"io"
	"runtime/metrics"
	"sync"
	"time"

	"github.com/qvd/qvd/internal/memstat"
)

// HostSource reads the host's figures. *memstat.Reader's figures with a cheap heap reading
// added; tests substitute fakes or point the live one at a fake /proc.
type HostSource interface {
	// Read returns the Go runtime's and /proc's figures; called once per step.
	Read() memstat.Snapshot
	// Heap returns the Go heap figures alone; called at every phase boundary, so it must not
	// touch /proc.
	Heap() Heap
}

// Heap is the Go heap at one moment.
type Heap struct {
	InUse uint64 // bytes of live and not yet collected objects ("/memory/classes/heap/objects:bytes")
	// Live is the heap the last collection found live ("/gc/heap/live:bytes"): what the
	// program holds, without garbage; 0 before the first collection.
	Live      uint64
	Allocated uint64 // bytes allocated since the process started ("/gc/heap/allocs:bytes"), never decreasing
}

// Clock is the time source for the swap rates (a manual clock in tests).
type Clock interface{ Now() time.Time }

type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }

// host is the live HostSource: /proc through memstat and the Go runtime's metrics.
type host struct {
	r       *memstat.Reader
	mu      sync.Mutex
	samples []metrics.Sample
}

var (
	_ HostSource = (*host)(nil)
	_ io.Closer  = (*host)(nil)
)

// NewHost returns the HostSource of this process and machine.
func NewHost() HostSource { return newHost(memstat.NewReader()) }

// NewHostAt reads the /proc files under root instead of /proc, and no cgroup (tests).
func NewHostAt(root string) HostSource { return newHost(memstat.NewReaderAt(root)) }

// NewHostAtRoots reads the /proc files under proc and the memory cgroup they name with its
// mount points under root instead of / (tests; see memstat.NewReaderAtRoots).
func NewHostAtRoots(proc, root string) HostSource {
	return newHost(memstat.NewReaderAtRoots(proc, root))
}

func newHost(r *memstat.Reader) *host {
	return &host{r: r, samples: []metrics.Sample{
		{Name: "/memory/classes/heap/objects:bytes"},
		{Name: "/gc/heap/allocs:bytes"},
		{Name: "/gc/heap/live:bytes"},
	}}
}

func (h *host) Read() memstat.Snapshot { return h.r.Read() }

func (h *host) Heap() Heap {
	h.mu.Lock()
	defer h.mu.Unlock()
	metrics.Read(h.samples)
	return Heap{InUse: sampleUint64(h.samples[0]), Allocated: sampleUint64(h.samples[1]), Live: sampleUint64(h.samples[2])}
}

func (h *host) Close() error { return h.r.Close() }

func sampleUint64(s metrics.Sample) uint64 {
	if s.Value.Kind() != metrics.KindUint64 {
		return 0 // a metric this Go version does not know: unknown
	}
	return s.Value.Uint64()
}
