package memory

import (
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/qvd/qvd/internal/memstat"
)

// fakeHost returns scripted readings: snap for Read, heap for Heap.
type fakeHost struct {
	mu   sync.Mutex
	snap memstat.Snapshot
	heap Heap
}

func (f *fakeHost) Read() memstat.Snapshot {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.snap
}

func (f *fakeHost) Heap() Heap {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.heap
}

func (f *fakeHost) set(fn func(*fakeHost)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	fn(f)
}

type manualClock struct{ t time.Time }

func (c *manualClock) Now() time.Time          { return c.t }
func (c *manualClock) advance(d time.Duration) { c.t = c.t.Add(d) }

func newTestMonitor(t *testing.T, cfg Config, h HostSource, d DeviceSource) (*Monitor, *manualClock) {
	t.Helper()
	clk := &manualClock{t: time.Unix(1700000000, 0)}
	if d == nil {
		d = NoDevices{Reason: "NVML not found (test)"}
	}
	m, err := New(cfg, Options{Host: h, Device: d, Clock: clk})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m, clk
}

// fakeProc writes a /proc stand-in with the given MemTotal, MemAvailable (KiB) and swap counters.
func writeProc(t *testing.T, root string, totalKiB, availKiB, swapIn, swapOut int) {
	t.Helper()
	files := map[string]string{
		"self/statm": "1000 250 100 5 0 100 0\n",
		"meminfo":    "MemTotal:       " + itoa(totalKiB) + " kB\nMemFree:        1 kB\nMemAvailable:   " + itoa(availKiB) + " kB\n",
		"vmstat":     "nr_free_pages 1\npswpin " + itoa(swapIn) + "\npswpout " + itoa(swapOut) + "\n",
	}
	for name, content := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func itoa(n int) string { return strconv.Itoa(n) }

func TestFakeProcSwapRatesAndPressure(t *testing.T) {
	root := t.TempDir()
	const total = 16 << 20 // KiB: a 16 GiB machine
	writeProc(t, root, total, 8<<20, 100, 200)
	m, clk := newTestMonitor(t, Config{LogEvery: 10, MinAvailable: "10%"}, NewHostAt(root), nil)

	r := m.Observe(1, nil)
	if r.Host.Total != total<<10 || r.Host.Available != 8<<30 || r.Host.RSS != 250*uint64(os.Getpagesize()) {
		t.Fatalf("host figures from the fake /proc: %+v", r.Host)
	}
	if r.SwapInRate != 0 || r.SwapOutRate != 0 || r.Pressure {
		t.Fatalf("first sample: no interval yet, no pressure: %+v", r)
	}
	if r.MinAvailable != (total<<10)/10 {
		t.Fatalf("min_available 10%% of %d = %d", total<<10, r.MinAvailable)
	}

	// Two seconds later 40 pages came in and 100 went out: 20 and 50 pages/s.
	clk.advance(2 * time.Second)
	writeProc(t, root, total, 8<<20, 140, 300)
	r = m.Observe(2, nil)
	if r.SwapInRate != 20 || r.SwapOutRate != 50 {
		t.Fatalf("swap rates %v/%v pages/s, want 20/50", r.SwapInRate, r.SwapOutRate)
	}
	if !r.Pressure || !r.PressureStarted || !r.Log || !strings.Contains(r.Reason, "swapping: 20 pages/s in, 50 pages/s out") {
		t.Fatalf("swapping must be pressure, logged once: %+v", r)
	}
	if p, why := m.Pressure(); !p || why != r.Reason {
		t.Fatalf("Pressure() = %v, %q", p, why)
	}

	// Swapping stops, but available memory falls to 1 GiB: under 10% of 16 GiB.
	clk.advance(time.Second)
	writeProc(t, root, total, 1<<20, 140, 300)
	r = m.Observe(3, nil)
	if !r.Pressure || r.PressureStarted || r.SwapInRate != 0 {
		t.Fatalf("still under pressure (no new start): %+v", r)
	}
	want := "available memory 1.0 GiB is below memory.min_available 10% (1.6 GiB of 16.0 GiB)"
	if r.Reason != want {
		t.Fatalf("reason %q, want %q", r.Reason, want)
	}

	// Recovered.
	clk.advance(time.Second)
	writeProc(t, root, total, 12<<20, 140, 300)
	if r = m.Observe(4, nil); r.Pressure || r.Reason != "" {
		t.Fatalf("recovered: %+v", r)
	}
	if p, _ := m.Pressure(); p {
		t.Fatal("Pressure() after recovery")
	}
}

func TestPressureThresholdInBytes(t *testing.T) {
	h := &fakeHost{snap: memstat.Snapshot{HeapInUse: 1, Total: 64 << 30, Available: 3 << 30}}
	m, _ := newTestMonitor(t, Config{MinAvailable: "4GiB"}, h, nil)
	r := m.Observe(1, nil)
	if !r.Pressure || r.Reason != "available memory 3.0 GiB is below memory.min_available 4GiB" {
		t.Fatalf("%+v", r)
	}
	// Unknown available memory (no /proc) is not pressure.
	h.set(func(f *fakeHost) { f.snap.Available = 0 })
	if r := m.Observe(2, nil); r.Pressure {
		t.Fatalf("unknown figures reported as pressure: %+v", r)
	}
	// "0" turns the check off.
	m0, _ := newTestMonitor(t, Config{MinAvailable: "0"}, &fakeHost{snap: memstat.Snapshot{Total: 8 << 30, Available: 1}}, nil)
	if r := m0.Observe(1, nil); r.Pressure {
		t.Fatalf("min_available 0: %+v", r)
	}
}

func TestSwapCounterGoingBackwardsIsNoRate(t *testing.T) {
	if r := rate(500, 100, 1); r != 0 {
		t.Fatalf("rate = %v", r)
	}
	if r := rate(1, 11, 0); r != 0 {
		t.Fatalf("zero interval: rate = %v", r)
	}
	if r := rate(1, 11, 0.5); r != 20 {
		t.Fatalf("rate = %v, want 20", r)
	}
}

func TestHumanLine(t *testing.T) {
	h := &fakeHost{snap: memstat.Snapshot{HeapInUse: 8805674598, RSS: 9 << 30, Available: 16965120819, Total: 32 << 30}}
	m, _ := newTestMonitor(t, DefaultConfig(), h, nil)
	r := m.Observe(1, nil)
	h.set(func(f *fakeHost) { f.snap.HeapInUse = 1 << 30 })
	r = m.Observe(2, nil)
	if got, want := r.Line(), "Memory - Allocated: 1.0 GiB, Free: 15.8 GiB, Max Used: 8.2 GiB"; got != want {
		t.Fatalf("Line() = %q, want %q", got, want)
	}
	h.set(func(f *fakeHost) { f.snap.Available = 0 })
	if got := m.Observe(3, nil).Line(); got != "Memory - Allocated: 1.0 GiB, Free: unknown, Max Used: 8.2 GiB" {
		t.Fatalf("Line() without /proc = %q", got)
	}
}

func TestLogEveryAndPeaks(t *testing.T) {
	h := &fakeHost{snap: memstat.Snapshot{HeapInUse: 300 << 20, Available: 1 << 30, Total: 2 << 30}, heap: Heap{Live: 100 << 20}}
	m, _ := newTestMonitor(t, Config{LogEvery: 5, MinAvailable: "1%"}, h, nil)
	var logged []int64
	heap := map[int64]uint64{3: 105 << 20, 4: 120 << 20, 7: 125 << 20, 9: 140 << 20}
	for step := int64(1); step <= 10; step++ {
		if v, ok := heap[step]; ok {
			h.set(func(f *fakeHost) { f.heap.Live = v })
		}
		r := m.Observe(step, nil)
		if r.Live != h.heap.Live || r.MaxLive < r.Live {
			t.Fatalf("live %d, max %d", r.Live, r.MaxLive)
		}
		if r.Log {
			logged = append(logged, step)
			if !r.Periodic && !r.NewPeak {
				t.Fatalf("step %d logged without a reason", step)
			}
			if r.DeviceErr == nil || !errors.Is(r.DeviceErr, ErrNoDevice) {
				t.Fatalf("step %d: devices not read for a logged report: %v", step, r.DeviceErr)
			}
		} else if r.DeviceErr != nil || r.Devices != nil {
			t.Fatalf("step %d: devices read for a report not logged", step)
		}
	}
	// 1: first sample; 4: 120 > 1.1×100; 5, 10: periodic; 7 (125) is < 1.1×120; 9: 140 > 1.1×125.
	if want := []int64{1, 4, 5, 9, 10}; !equal(logged, want) {
		t.Fatalf("logged at %v, want %v", logged, want)
	}
}

func equal(a, b []int64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestPhasePeaks(t *testing.T) {
	h := &fakeHost{snap: memstat.Snapshot{HeapInUse: 10 << 20}}
	m, _ := newTestMonitor(t, DefaultConfig(), h, nil)
	run := func(name string, startAlloc, endAlloc, heapAtEnd uint64) {
		h.set(func(f *fakeHost) { f.heap.Allocated = startAlloc })
		p := m.Begin(name)
		h.set(func(f *fakeHost) { f.heap = Heap{InUse: heapAtEnd, Allocated: endAlloc} })
		p.End()
	}
	run(PhaseForwardBackward, 0, 30<<20, 200<<20)
	run(PhaseCommunication, 30<<20, 31<<20, 150<<20)
	run(PhaseOptimizer, 31<<20, 31<<20, 160<<20)
	run(PhaseForwardBackward, 31<<20, 41<<20, 180<<20)

	got := m.Phases()
	want := []PhaseStats{
		{Name: PhaseForwardBackward, Count: 2, LastHeap: 180 << 20, PeakHeap: 200 << 20, LastAllocated: 10 << 20, MaxAllocated: 30 << 20},
		{Name: PhaseCommunication, Count: 1, LastHeap: 150 << 20, PeakHeap: 150 << 20, LastAllocated: 1 << 20, MaxAllocated: 1 << 20},
		{Name: PhaseOptimizer, Count: 1, LastHeap: 160 << 20, PeakHeap: 160 << 20},
	}
	if len(got) != len(want) {
		t.Fatalf("phases %+v", got)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("phase %d: %+v, want %+v", i, got[i], want[i])
		}
	}
	// The phase peak is the overall peak, though the step's own sample is lower.
	r := m.Observe(1, nil)
	if r.MaxHeap != 200<<20 || len(r.Phases) != 3 {
		t.Fatalf("max heap %d, phases %d", r.MaxHeap, len(r.Phases))
	}
	if got, want := r.PhaseLine(), "forward+backward 200.0 MiB (+30.0 MiB allocated), communication 150.0 MiB (+1.0 MiB allocated), optimizer 160.0 MiB (+0 B allocated)"; got != want {
		t.Fatalf("PhaseLine() = %q, want %q", got, want)
	}
}

func TestAccounting(t *testing.T) {
	m, _ := newTestMonitor(t, DefaultConfig(), &fakeHost{}, nil)
	m.Observe(1, map[string]int64{"device_params": 100, "device_comm_buffers": 50})
	r := m.Observe(2, map[string]int64{"device_params": 100, "device_comm_buffers": 20})
	if r.Accounted != 120 || r.MaxAccounted != 150 {
		t.Fatalf("accounted %d, max %d", r.Accounted, r.MaxAccounted)
	}
	if got := m.MaxAccounted(); got["device_comm_buffers"] != 50 || got["device_params"] != 100 {
		t.Fatalf("max by category %v", got)
	}
}

func TestScopedMeasure(t *testing.T) {
	h := &fakeHost{snap: memstat.Snapshot{HeapInUse: 100 << 20, RSS: 300 << 20}, heap: Heap{Allocated: 1 << 30}}
	m, clk := newTestMonitor(t, DefaultConfig(), h, nil)
	s := m.Measure("first step")
	h.set(func(f *fakeHost) {
		f.snap.HeapInUse, f.snap.RSS = 90<<20, 340<<20
		f.heap.Allocated += 25 << 20
	})
	clk.advance(35 * time.Millisecond)
	d := s.Done()
	if d.Heap != -10<<20 || d.RSS != 40<<20 || d.Allocated != 25<<20 || d.Duration != 35*time.Millisecond {
		t.Fatalf("delta %+v", d)
	}
	if got, want := d.String(), "first step: heap -10.0 MiB (now 90.0 MiB), RSS +40.0 MiB (now 340.0 MiB), 25.0 MiB allocated, 35ms"; got != want {
		t.Fatalf("String() = %q, want %q", got, want)
	}

	// The package-level measure sees a real allocation held across it.
	live := Measure("allocate")
	keep := make([]byte, 64<<20)
	for i := range keep {
		keep[i] = 1
	}
	d = live.Done()
	if d.Heap < 60<<20 || d.Allocated < 64<<20 {
		t.Fatalf("live measure of a 64 MiB allocation: %+v", d)
	}
	runtime.KeepAlive(keep)
}

func TestNilMonitorIsOff(t *testing.T) {
	var m *Monitor
	m.Begin("x").End()
	if r := m.Observe(3, nil); r.Log || r.Step != 3 {
		t.Fatalf("%+v", r)
	}
	if p, _ := m.Pressure(); p {
		t.Fatal("pressure on a nil monitor")
	}
	if d := m.Measure("x").Done(); d != (Delta{}) {
		t.Fatalf("%+v", d)
	}
	if m.Phases() != nil || m.MaxAccounted() != nil || m.Close() != nil {
		t.Fatal("nil monitor")
	}
}

func TestNoDeviceMessage(t *testing.T) {
	m, _ := newTestMonitor(t, DefaultConfig(), &fakeHost{}, NoDevices{Reason: "NVML not found (libnvidia-ml.so.1 could not be loaded)"})
	r := m.Observe(1, nil)
	if !r.Log || r.DeviceLine() != "no GPU: NVML not found (libnvidia-ml.so.1 could not be loaded)" {
		t.Fatalf("device line %q", r.DeviceLine())
	}
}

type twoGPUs struct{}

func (twoGPUs) Devices() ([]Device, error) {
	return []Device{
		{Index: 0, Name: "NVIDIA H100 80GB HBM3", Used: 12 << 30, Free: 67 << 30, Total: 79 << 30},
		{Index: 1, Name: "NVIDIA H100 80GB HBM3", Used: 1 << 30, Free: 78 << 30, Total: 79 << 30},
	}, nil
}

func TestDeviceLine(t *testing.T) {
	m, _ := newTestMonitor(t, DefaultConfig(), &fakeHost{}, twoGPUs{})
	r := m.Observe(1, nil)
	want := "GPU 0 NVIDIA H100 80GB HBM3: used 12.0 GiB, free 67.0 GiB of 79.0 GiB; GPU 1 NVIDIA H100 80GB HBM3: used 1.0 GiB, free 78.0 GiB of 79.0 GiB"
	if got := r.DeviceLine(); got != want {
		t.Fatalf("DeviceLine() = %q, want %q", got, want)
	}
}

func TestConfigValidate(t *testing.T) {
	if err := DefaultConfig().Validate(); err != nil {
		t.Fatalf("defaults: %v", err)
	}
	for _, c := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.LogEvery = -1 }, "log_every: must be >= 0"},
		{func(c *Config) { c.MinAvailable = "150%" }, "min_available: \"150%\" is not a percentage in [0, 100)"},
		{func(c *Config) { c.MinAvailable = "lots" }, "min_available: want a percentage"},
		{func(c *Config) { c.Limit = -5 }, "limit: must be >= 0"},
	} {
		cfg := DefaultConfig()
		c.edit(&cfg)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("want an error containing %q, got %v", c.want, err)
		}
	}
	if _, err := New(Config{LogEvery: -1}, Options{}); err == nil {
		t.Fatal("New accepted an invalid config")
	}
}

func TestParseBytes(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Bytes
	}{
		{"0", 0}, {"1048576", 1 << 20}, {"24GiB", 24 << 30}, {"16GB", 16e9}, {"512MiB", 512 << 20},
		{"1.5GiB", 3 << 29}, {" 2 KiB ", 2048}, {"100B", 100},
	} {
		if got, err := ParseBytes(c.in); err != nil || got != c.want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d", c.in, got, err, c.want)
		}
	}
	for _, bad := range []string{"", "-1GiB", "lots", "1XB", "NaN", "1e30GiB"} {
		if _, err := ParseBytes(bad); err == nil {
			t.Errorf("ParseBytes(%q) accepted", bad)
		}
	}
	for b, want := range map[Bytes]string{0: "0", 24 << 30: "24GiB", 1 << 20: "1MiB", 1536: "1536", 3 << 29: "1536MiB", 1000: "1000"} {
		if got := b.String(); got != want {
			t.Errorf("Bytes(%d).String() = %q, want %q", int64(b), got, want)
		}
	}
}

func TestConfigYAML(t *testing.T) {
	var c Config
	if err := yaml.Unmarshal([]byte("log_every: 50\nmin_available: 2147483648\nlimit: 24GiB\nadapt: true\n"), &c); err != nil {
		t.Fatal(err)
	}
	if c.LogEvery != 50 || c.MinAvailable != "2147483648" || c.Limit != 24<<30 || !c.Adapt {
		t.Fatalf("decoded %+v", c)
	}
	if got := c.MinAvailable.Of(1 << 40); got != 2<<30 {
		t.Fatalf("min_available in bytes resolves to %d", got)
	}
	out, err := yaml.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), "limit: 24GiB") {
		t.Fatalf("marshalled:\n%s", out)
	}
	var back Config
	if err := yaml.Unmarshal(out, &back); err != nil || back != c {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	if err := yaml.Unmarshal([]byte("limit: [1]\n"), &c); err == nil {
		t.Fatal("a list accepted as a size")
	}
	if err := yaml.Unmarshal([]byte("limit: lots\n"), &c); err == nil || !strings.Contains(err.Error(), "is not a size") {
		t.Fatalf("bad size: %v", err)
	}
}

func TestCheckLimit(t *testing.T) {
	states := States{Device: StateBytes{Params: 4 << 20, Grads: 4 << 20, Master: 0, Optimizer: 8 << 20}}
	if err := CheckLimit(0, states, 1<<40); err != nil {
		t.Fatalf("no limit: %v", err)
	}
	if err := CheckLimit(20<<20, states, 16<<20); err != nil { // 16 MiB usable of 20
		t.Fatalf("enough: %v", err)
	}
	if err := CheckLimit(20<<20, states, 40<<20); !errors.Is(err, ErrLimitTooLow) || !strings.Contains(err.Error(), "already holds 40.0 MiB") ||
		!strings.Contains(err.Error(), "at least 50MiB") {
		t.Fatalf("process larger than the limit: %v", err)
	}
	err := CheckLimit(16<<20, states, 0)
	if !errors.Is(err, ErrLimitTooLow) {
		t.Fatalf("err = %v", err)
	}
	for _, want := range []string{"memory.limit 16MiB", "leaves 12.8 MiB after 20% headroom", "need 16.0 MiB", "optimizer state 8.0 MiB", "at least 20MiB"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}
