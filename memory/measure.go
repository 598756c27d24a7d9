package memory

import (
	"fmt"
	"io"
	"runtime"
	"time"

	"github.com/qvd/qvd/internal/memstat"
)

// Measurement is a scoped measure in progress: the memory change across one operation.
//
//	m := memory.Measure("model build")
//	net, err := model.New(...)
//	log.Println(m.Done())
type Measurement struct {
	name      string
	host      HostSource
	clock     Clock
	ownHost   bool // opened for this measure: closed by Done
	before    memstat.Snapshot
	allocated uint64
	start     time.Time
}

// Delta is what an operation changed.
type Delta struct {
	Name string
	// Heap and RSS are the change in the live Go heap (measured after a collection at both
	// ends, so garbage does not count) and in the resident set; negative when memory was freed.
	Heap, RSS int64
	// HeapAfter and RSSAfter are the figures at the end.
	HeapAfter, RSSAfter uint64
	// Allocated is every byte allocated during the operation, garbage included.
	Allocated uint64
	Duration  time.Duration
}

// Measure starts a scoped measure on this process and machine, for code that has no Monitor.
func Measure(name string) *Measurement {
	return start(name, NewHost(), wallClock{}, true)
}

// Measure starts a scoped measure with the monitor's sources; on a nil Monitor it returns
// nil, whose Done returns a zero Delta.
func (m *Monitor) Measure(name string) *Measurement {
	if m == nil {
		return nil
	}
	return start(name, m.host, m.clock, false)
}

// settle collects garbage so that the heap reading is what is live. It costs one collection
// at each end of a measure, which is why measures are for one-off operations, not steps.
var settle = runtime.GC

func start(name string, h HostSource, c Clock, own bool) *Measurement {
	settle()
	return &Measurement{name: name, host: h, clock: c, ownHost: own, before: h.Read(), allocated: h.Heap().Allocated, start: c.Now()}
}

// Done ends the measure and returns the change.
func (s *Measurement) Done() Delta {
	if s == nil {
		return Delta{}
	}
	settle()
	after, alloc := s.host.Read(), s.host.Heap().Allocated
	if c, ok := s.host.(io.Closer); ok && s.ownHost {
		c.Close()
	}
	return Delta{
		Name: s.name,
		Heap: int64(after.HeapInUse) - int64(s.before.HeapInUse), RSS: int64(after.RSS) - int64(s.before.RSS),
		HeapAfter: after.HeapInUse, RSSAfter: after.RSS,
		Allocated: alloc - min(s.allocated, alloc), Duration: s.clock.Now().Sub(s.start),
	}
}

// String is "model build: heap +12.3 MiB (now 40.1 MiB), RSS +15.0 MiB (now 80.2 MiB),
// 20.4 MiB allocated, 35ms".
func (d Delta) String() string {
	return fmt.Sprintf("%s: heap %s (now %s), RSS %s (now %s), %s allocated, %v", d.Name,
		signedBytes(d.Heap), memstat.FormatBytes(d.HeapAfter), signedBytes(d.RSS), memstat.FormatBytes(d.RSSAfter),
		memstat.FormatBytes(d.Allocated), d.Duration.Round(time.Microsecond))
}

func signedBytes(v int64) string {
	if v < 0 {
		return "-" + memstat.FormatBytes(uint64(-v))
	}
	return "+" + memstat.FormatBytes(uint64(v))
}
