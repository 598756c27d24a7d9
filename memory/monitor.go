package memory

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"

	"github.com/qvd/qvd/internal/memstat"
)

// Phase names the trainer uses.
const (
	// PhaseForwardBackward is one micro-batch's forward and backward pass: gorgonia's tape
	// machine runs both in one pass over one program, so they cannot be told apart. At ZeRO
	// stage 2 it includes the gradient reduce-scatter that streams out of the backward pass.
	PhaseForwardBackward = "forward+backward"
	// PhaseCommunication is the gradient all-reduce (or the end of the stage-2
	// reduce-scatter), the loss all-reduce and the gradient norm's reduction.
	PhaseCommunication = "communication"
	// PhaseOptimizer is the optimizer step, and at stages 1-2 the parameters' all-gather.
	PhaseOptimizer = "optimizer"
)

// peakGrowth is how far the live heap must rise above the largest one logged before a new
// peak is logged: 10%, so that small drifts do not log every step. The live heap (what the
// last collection kept) is used rather than the heap in use, which climbs with garbage to the
// collector's goal and falls back every cycle.
const peakGrowth = 1.10

// Options are the Monitor's sources; zero fields take the live ones.
type Options struct {
	Host   HostSource   // default: this process and machine (/proc, Go runtime)
	Device DeviceSource // default: OpenNVML()
	Clock  Clock        // default: the wall clock
}

// Monitor samples memory once per step and at phase boundaries; see the package comment.
type Monitor struct {
	cfg       Config
	host      HostSource
	dev       DeviceSource
	clock     Clock
	closeOnce sync.Once

	mu struct {
		sync.Mutex
		last       memstat.Snapshot // the previous Observe's reading
		lastNanos  int64            // its time, Unix nanoseconds (0: none yet)
		swapIn     float64          // pages per second over the last interval
		swapOut    float64
		maxHeap    uint64
		maxRSS     uint64
		maxLive    uint64
		loggedPeak uint64 // maxLive when a line was last logged
		accounted  int64
		maxAcct    int64
		maxByCat   map[string]int64
		phases     []PhaseStats
		pressure   bool
		reason     string
	}
}

// New returns a Monitor for cfg; it fails only if cfg is invalid.
func New(cfg Config, o Options) (*Monitor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	m := &Monitor{cfg: cfg, host: o.Host, dev: o.Device, clock: o.Clock}
	if m.host == nil {
		m.host = NewHost()
	}
	if m.dev == nil {
		m.dev = OpenNVML()
	}
	if m.clock == nil {
		m.clock = wallClock{}
	}
	m.mu.maxByCat = map[string]int64{}
	return m, nil
}

// Close releases the sources that hold resources (the /proc files, NVML); safe to call twice.
func (m *Monitor) Close() error {
	if m == nil {
		return nil
	}
	var errs []error
	m.closeOnce.Do(func() {
		for _, s := range []any{m.host, m.dev} {
			if c, ok := s.(io.Closer); ok {
				errs = append(errs, c.Close())
			}
		}
	})
	return errors.Join(errs...)
}

// Config returns the configuration the monitor was built with.
func (m *Monitor) Config() Config { return m.cfg }

// PhaseStats is what one phase has used so far.
type PhaseStats struct {
	Name  string
	Count int64 // times the phase has ended
	// LastHeap and PeakHeap are the Go heap in use when the phase last ended and the largest
	// such sample (see the package comment for what a heap peak means).
	LastHeap, PeakHeap uint64
	// LastAllocated and MaxAllocated are the bytes allocated during the phase's last run and
	// during its most allocating run: the garbage a phase makes, which the peaks do not show.
	LastAllocated, MaxAllocated uint64
}

// Phase is one run of a phase, from Begin to End.
type Phase struct {
	m     *Monitor
	name  string
	start uint64 // bytes allocated at Begin
}

// Begin starts a run of the named phase. It reads only the Go runtime (no /proc), so it is
// cheap enough for every micro-batch.
func (m *Monitor) Begin(name string) Phase {
	if m == nil {
		return Phase{}
	}
	return Phase{m: m, name: name, start: m.host.Heap().Allocated}
}

// End samples the heap and updates the phase's figures and the overall heap peak.
func (p Phase) End() {
	m := p.m
	if m == nil {
		return
	}
	h := m.host.Heap()
	alloc := h.Allocated - min(p.start, h.Allocated)
	m.mu.Lock()
	defer m.mu.Unlock()
	i := 0
	for i < len(m.mu.phases) && m.mu.phases[i].Name != p.name {
		i++
	}
	if i == len(m.mu.phases) {
		m.mu.phases = append(m.mu.phases, PhaseStats{Name: p.name})
	}
	s := &m.mu.phases[i]
	s.Count++
	s.LastHeap, s.PeakHeap = h.InUse, max(s.PeakHeap, h.InUse)
	s.LastAllocated, s.MaxAllocated = alloc, max(s.MaxAllocated, alloc)
	m.mu.maxHeap = max(m.mu.maxHeap, h.InUse)
}

// Phases returns the phases' figures in the order they first ran.
func (m *Monitor) Phases() []PhaseStats {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]PhaseStats(nil), m.mu.phases...)
}

// Report is one Observe: the figures of a step and whether they are worth a log line.
type Report struct {
	Step int64
	Host memstat.Snapshot
	// SwapInRate and SwapOutRate are pages swapped in and out per second since the previous
	// Observe (pswpin, pswpout in /proc/vmstat); zero at the first.
	SwapInRate, SwapOutRate float64
	MaxHeap, MaxRSS         uint64 // the largest samples so far
	// Live is the heap the last garbage collection kept, MaxLive the largest seen: what the
	// process holds, without the garbage that HeapInUse includes.
	Live, MaxLive uint64
	// Accounted is the total of the accounting the caller passed, MaxAccounted its largest.
	Accounted, MaxAccounted int64
	// MinAvailable is memory.min_available in bytes for this machine (0: no check).
	MinAvailable uint64
	Phases       []PhaseStats

	// Devices and DeviceErr are read only when Log is set.
	Devices   []Device
	DeviceErr error

	// Log says the report deserves a line: it is the monitor's first (First), LogEvery steps
	// have passed (Periodic), the live heap reached a new peak, 10% above the largest logged
	// (NewPeak), or pressure began (PressureStarted).
	Log, First, Periodic, NewPeak bool
	// Pressure says the host (or this process's memory cgroup, when its limit is the one
	// that applies: Host.LimitedBy) is short of memory now; Reason gives the numbers.
	// PressureStarted is set when pressure begins, and again whenever the cgroup's OOM
	// killer has struck since the previous Observe, so that each kill is reported once.
	Pressure, PressureStarted bool
	Reason                    string
	// NewOOMKills is how many processes the OOM killer took under the memory cgroup's limit
	// since the previous Observe (the rise of Host.CgroupOOMKills; zero at the first).
	NewOOMKills uint64
}

// Observe takes the step's sample: host figures, swap rates, peaks, the caller's accounting
// by category (bytes; nil for none), pressure, and, if the report is to be logged, the devices.
func (m *Monitor) Observe(step int64, accounted map[string]int64) Report {
	if m == nil {
		return Report{Step: step}
	}
	s, live := m.host.Read(), m.host.Heap().Live
	now := m.clock.Now().UnixNano()
	m.mu.Lock()
	r := Report{Step: step, Host: s}
	r.First = m.mu.lastNanos == 0
	if m.mu.lastNanos != 0 && now > m.mu.lastNanos {
		dt := float64(now-m.mu.lastNanos) / 1e9
		m.mu.swapIn = rate(m.mu.last.SwapInPages, s.SwapInPages, dt)
		m.mu.swapOut = rate(m.mu.last.SwapOutPages, s.SwapOutPages, dt)
	}
	if m.mu.lastNanos != 0 && s.CgroupOOMKills > m.mu.last.CgroupOOMKills {
		r.NewOOMKills = s.CgroupOOMKills - m.mu.last.CgroupOOMKills
	}
	m.mu.last, m.mu.lastNanos = s, now
	r.SwapInRate, r.SwapOutRate = m.mu.swapIn, m.mu.swapOut

	m.mu.maxHeap = max(m.mu.maxHeap, s.HeapInUse)
	m.mu.maxRSS = max(m.mu.maxRSS, s.RSS)
	m.mu.maxLive = max(m.mu.maxLive, live)
	r.MaxHeap, r.MaxRSS = m.mu.maxHeap, m.mu.maxRSS
	r.Live, r.MaxLive = live, m.mu.maxLive
	r.NewPeak = float64(m.mu.maxLive) > peakGrowth*float64(m.mu.loggedPeak)

	var total int64
	for k, v := range accounted {
		total += v
		if v > m.mu.maxByCat[k] {
			m.mu.maxByCat[k] = v
		}
	}
	m.mu.accounted, m.mu.maxAcct = total, max(m.mu.maxAcct, total)
	r.Accounted, r.MaxAccounted = total, m.mu.maxAcct

	r.MinAvailable = m.cfg.MinAvailable.Of(s.Total)
	r.Pressure, r.Reason = pressure(s, r.MinAvailable, m.cfg.MinAvailable, r.SwapInRate, r.SwapOutRate, r.NewOOMKills)
	r.PressureStarted = r.Pressure && (!m.mu.pressure || r.NewOOMKills > 0)
	m.mu.pressure, m.mu.reason = r.Pressure, r.Reason

	r.Periodic = m.cfg.LogEvery > 0 && step%int64(m.cfg.LogEvery) == 0
	r.Log = r.First || r.Periodic || r.NewPeak || r.PressureStarted
	if r.Log {
		m.mu.loggedPeak = m.mu.maxLive
		r.Phases = append([]PhaseStats(nil), m.mu.phases...)
	}
	m.mu.Unlock()
	if r.Log {
		r.Devices, r.DeviceErr = m.dev.Devices()
	}
	return r
}

// MaxAccounted returns the largest value seen for each accounting category.
func (m *Monitor) MaxAccounted() map[string]int64 {
	if m == nil {
		return nil
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make(map[string]int64, len(m.mu.maxByCat))
	for k, v := range m.mu.maxByCat {
		out[k] = v
	}
	return out
}

// Pressure reports whether the host was short of memory at the last Observe — available
// memory below memory.min_available, or pages swapped in or out since the sample before —
// and, if so, why, with the numbers. It is the signal for memory.adapt.
func (m *Monitor) Pressure() (bool, string) {
	if m == nil {
		return false, ""
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.mu.pressure, m.mu.reason
}

// rate is the increase of a cumulative counter per second; a counter that went backwards
// (reset, or a different source) counts as no change.
func rate(before, after uint64, seconds float64) float64 {
	if after <= before || seconds <= 0 {
		return 0
	}
	return float64(after-before) / seconds
}

func pressure(s memstat.Snapshot, floor uint64, setting Threshold, in, out float64, oomKills uint64) (bool, string) {
	var why []string
	// Available 0 means unknown (no /proc), not an empty machine, unless it is the cgroup's.
	if floor > 0 && (s.Available > 0 || s.LimitedBy == memstat.LimitCgroup) && s.Available < floor {
		msg := fmt.Sprintf("available memory %s%s is below memory.min_available %s", memstat.FormatBytes(s.Available), limitNote(s), setting)
		if strings.HasSuffix(string(setting), "%") && s.Total > 0 {
			msg += fmt.Sprintf(" (%s of %s)", memstat.FormatBytes(floor), memstat.FormatBytes(s.Total))
		}
		why = append(why, msg)
	}
	if in > 0 || out > 0 {
		why = append(why, fmt.Sprintf("the machine is swapping: %s pages/s in, %s pages/s out", formatRate(in), formatRate(out)))
	}
	if oomKills > 0 {
		why = append(why, fmt.Sprintf("the OOM killer took %d process(es) under the memory cgroup's limit since the previous step (oom_kill %d in %s)",
			oomKills, s.CgroupOOMKills, cgroupName(s)))
	}
	return len(why) > 0, strings.Join(why, "; ")
}

// limitNote says, after an available figure, where it comes from when it is the cgroup's.
func limitNote(s memstat.Snapshot) string {
	if s.LimitedBy != memstat.LimitCgroup {
		return ""
	}
	return fmt.Sprintf(" (memory cgroup %s: limit %s, working set %s)", cgroupName(s), memstat.FormatBytes(s.CgroupLimit), memstat.FormatBytes(s.CgroupWorkingSet))
}

func cgroupName(s memstat.Snapshot) string {
	if s.CgroupDir == "" {
		return "this process's memory cgroup"
	}
	return s.CgroupDir
}

// LimitLine says which memory limit applies to this process, with the figures (see
// memstat.Snapshot.LimitString).
func (r Report) LimitLine() string { return r.Host.LimitString() }

func formatRate(v float64) string { return strconv.FormatFloat(v, 'f', 0, 64) }

// Line is the report's summary in the form the memory guides use:
// "Memory - Allocated: 245.3 MiB, Free: 21.4 GiB, Max Used: 310.2 MiB" — Allocated is the Go
// heap in use, Free the memory the system has available, Max Used the largest heap sample.
// When the memory cgroup's limit is what applies, Free says so: "Free: 189.9 MiB of cgroup
// limit 256.0 MiB".
func (r Report) Line() string {
	free := "unknown"
	switch {
	case r.Host.LimitedBy == memstat.LimitCgroup:
		free = memstat.FormatBytes(r.Host.Available) + " of cgroup limit " + memstat.FormatBytes(r.Host.CgroupLimit)
	case r.Host.Available > 0:
		free = memstat.FormatBytes(r.Host.Available)
	}
	return "Memory - Allocated: " + memstat.FormatBytes(r.Host.HeapInUse) + ", Free: " + free + ", Max Used: " + memstat.FormatBytes(r.MaxHeap)
}

// PhaseLine lists the phases' heap peaks and their most allocating runs:
// "forward+backward 240.1 MiB (+3.2 MiB allocated), communication 238.0 MiB (+0 B allocated), ...".
func (r Report) PhaseLine() string {
	parts := make([]string, len(r.Phases))
	for i, p := range r.Phases {
		parts[i] = fmt.Sprintf("%s %s (+%s allocated)", p.Name, memstat.FormatBytes(p.PeakHeap), memstat.FormatBytes(p.MaxAllocated))
	}
	return strings.Join(parts, ", ")
}

// DeviceLine is "GPU 0 NVIDIA H100: used 1.2 GiB, free 77.9 GiB of 79.1 GiB; GPU 1 ...", or
// why there is no GPU figure ("no GPU: NVML not found (...)").
func (r Report) DeviceLine() string {
	var parts []string
	for _, d := range r.Devices {
		name := ""
		if d.Name != "" {
			name = " " + d.Name
		}
		parts = append(parts, fmt.Sprintf("GPU %d%s: used %s, free %s of %s", d.Index, name,
			memstat.FormatBytes(d.Used), memstat.FormatBytes(d.Free), memstat.FormatBytes(d.Total)))
	}
	if r.DeviceErr != nil {
		parts = append(parts, r.DeviceErr.Error())
	}
	return strings.Join(parts, "; ")
}
