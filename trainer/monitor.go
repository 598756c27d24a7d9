package trainer

import (
	"fmt"
	"maps"
	"strconv"

	"go.uber.org/zap"

	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/memory"
)

// monitorState is the trainer's side of the memory monitor.
type monitorState struct {
	measured map[string]bool // phases whose first run has been measured
	pressure bool            // pressure was reported at the last step
}

// phaseRun is one run of a phase; on the phase's first run it also takes a scoped measure.
type phaseRun struct {
	t *Trainer
	p memory.Phase
	m *memory.Measurement
}

// beginPhase starts a phase on the monitor (nothing without one).
func (t *Trainer) beginPhase(name string) phaseRun {
	if t.out.mon == nil {
		return phaseRun{}
	}
	r := phaseRun{t: t}
	if !t.out.monState.measured[name] {
		if t.out.monState.measured == nil {
			t.out.monState.measured = map[string]bool{}
		}
		t.out.monState.measured[name] = true
		r.m = t.out.mon.Measure("first " + name)
	}
	r.p = t.out.mon.Begin(name)
	return r
}

func (r phaseRun) end() {
	if r.t == nil {
		return
	}
	r.p.End()
	if r.m != nil {
		d := r.m.Done()
		r.t.log.Info("memory change: "+d.String(), zap.Int64("step", r.t.pos.step+1), zap.String("what", d.Name),
			zap.Int64("heap_delta_bytes", d.Heap), zap.Int64("rss_delta_bytes", d.RSS), zap.Uint64("allocated_bytes", d.Allocated))
	}
}

// observeMemory fills rec's memory figures: from the monitor when there is one (and logs its
// line and pressure), else heap and RSS alone.
func (t *Trainer) observeMemory(rec *metrics.Record) {
	rec.Memory = t.memoryRecord()
	if t.out.mon == nil {
		snap := t.out.mem.Read()
		rec.HeapBytes, rec.RSSBytes = snap.HeapInUse, snap.RSS
		t.observeDevice(rec)
		return
	}
	r := t.out.mon.Observe(t.pos.step, rec.Memory)
	rec.HeapBytes, rec.RSSBytes = r.Host.HeapInUse, r.Host.RSS
	rec.AvailableBytes, rec.MaxHeapBytes, rec.LiveHeapBytes = r.Host.Available, r.MaxHeap, r.Live
	rec.SwapInRate, rec.SwapOutRate = r.SwapInRate, r.SwapOutRate
	if ph := t.out.mon.Phases(); len(ph) > 0 {
		rec.PhaseHeap = make(map[string]int64, len(ph))
		for _, p := range ph {
			rec.PhaseHeap[p.Name] = int64(p.PeakHeap)
		}
	}
	if len(r.Devices) > 0 {
		rec.GPU = make(map[string]int64, 3*len(r.Devices))
		for _, d := range r.Devices {
			k := "gpu" + strconv.Itoa(d.Index) + "_"
			rec.GPU[k+"used"], rec.GPU[k+"free"], rec.GPU[k+"total"] = int64(d.Used), int64(d.Free), int64(d.Total)
		}
	}
	t.observeDevice(rec)
	switch {
	case r.Pressure && (r.PressureStarted || r.Periodic):
		t.log.Warn("host memory pressure: "+r.Reason, zap.Int64("step", t.pos.step),
			zap.Uint64("available_bytes", r.Host.Available), zap.Uint64("min_available_bytes", r.MinAvailable),
			zap.Uint64("total_bytes", r.Host.Total), zap.Float64("swap_in_pages_per_sec", r.SwapInRate),
			zap.Float64("swap_out_pages_per_sec", r.SwapOutRate), zap.Uint64("rss_bytes", r.Host.RSS))
	case !r.Pressure && t.out.monState.pressure:
		t.log.Info("host memory pressure is over", zap.Int64("step", t.pos.step), zap.Uint64("available_bytes", r.Host.Available))
	}
	t.out.monState.pressure = r.Pressure
	if r.Log {
		t.logMonitor(r)
	}
}

// logMonitor logs the monitor's line with what explains it.
func (t *Trainer) logMonitor(r memory.Report) {
	why := "every " + strconv.Itoa(t.out.mon.Config().LogEvery) + " steps"
	switch {
	case r.First:
		why = "first step"
	case r.PressureStarted:
		why = "memory pressure"
	case r.NewPeak:
		why = "new peak"
	}
	fields := []zap.Field{
		zap.Int64("step", r.Step), zap.String("why", why),
		zap.String("live_heap", memstat.FormatBytes(r.Live)), zap.String("max_live_heap", memstat.FormatBytes(r.MaxLive)),
		zap.String("rss", memstat.FormatBytes(r.Host.RSS)), zap.String("max_rss", memstat.FormatBytes(r.MaxRSS)),
		zap.String("model_states", fmt.Sprintf("%s (max %s)", memstat.FormatBytes(uint64(r.Accounted)), memstat.FormatBytes(uint64(r.MaxAccounted)))),
		zap.String("swap_pages_per_sec", fmt.Sprintf("%.0f in, %.0f out", r.SwapInRate, r.SwapOutRate)),
	}
	if len(r.Phases) > 0 {
		fields = append(fields, zap.String("phase_peaks", r.PhaseLine()))
	}
	if line := r.DeviceLine(); line != "" {
		fields = append(fields, zap.String("gpu", line))
	}
	t.log.Info(r.Line(), fields...)
}

// DeviceMemoryReporter is a Model with its own device allocator (the GPU engine): its figures
// (allocated, reserved and their peaks) go into the metrics' gpu map beside NVML's.
type DeviceMemoryReporter interface {
	DeviceMemory() map[string]int64
}

func (t *Trainer) observeDevice(rec *metrics.Record) {
	d, ok := t.model.(DeviceMemoryReporter)
	if !ok {
		return
	}
	if rec.GPU == nil {
		rec.GPU = map[string]int64{}
	}
	maps.Copy(rec.GPU, d.DeviceMemory())
}
