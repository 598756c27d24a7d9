package trainer

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/model"
)

// pressuredHost is a host source over a fake /proc: a 16 GiB machine with 1 GiB available,
// which is memory pressure at the default 10% threshold.
func pressuredHost(t *testing.T) memory.HostSource {
	t.Helper()
	root := t.TempDir()
	for name, content := range map[string]string{
		"self/statm": "1000 250 100 5 0 100 0\n",
		"meminfo":    "MemTotal: 16777216 kB\nMemAvailable: 1048576 kB\n",
		"vmstat":     "pswpin 0\npswpout 0\n",
	} {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return memory.NewHostAt(root)
}

// TestMemoryMonitorFigures runs a short training with a monitor on a fake /proc (16 GiB, of
// which 1 GiB available: pressure) and checks the metrics and the log.
func TestMemoryMonitorFigures(t *testing.T) {
	mon, err := memory.New(memory.Config{LogEvery: 4, MinAvailable: "10%"},
		memory.Options{Host: pressuredHost(t), Device: memory.NoDevices{Reason: "NVML not found (test)"}})
	if err != nil {
		t.Fatal(err)
	}
	defer mon.Close()
	core, logs := observer.New(zap.InfoLevel)

	r := defaultRun()
	r.cfg.Epochs = 2 // 160 samples / 32 = 5 steps per epoch: 10 steps
	spec, err := model.NewSpec(r.model, []int{1, 8, 8}, 4)
	if err != nil {
		t.Fatal(err)
	}
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	model.Init(spec, layout, params, r.seed)
	net, err := model.New(spec, layout, params, model.Options{MicroBatch: r.cfg.MicroBatch, EvalBatch: r.cfg.EvalBatch, Grad: r.cfg.Format()})
	if err != nil {
		t.Fatal(err)
	}
	defer net.Close()
	rec := &recorder{}
	tr, err := New(Setup{
		Config: r.cfg, Schedule: r.sched, Scaler: r.scaler, Optimizer: r.opt, Zero: r.zero, Seed: r.seed,
		Model: net, Train: r.train, Test: r.test, Normalize: data.Normalize{Mean: 0.5, Std: 0.25},
		Metrics: rec, Logger: zap.New(core), MemoryMonitor: mon,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if _, err := tr.Run(context.Background()); err != nil {
		t.Fatal(err)
	}

	steps := 0
	for _, m := range rec.recs {
		if m.Kind != metrics.KindTrain {
			continue
		}
		steps++
		if m.AvailableBytes != 1<<30 || m.RSSBytes != 250*uint64(os.Getpagesize()) || m.HeapBytes == 0 || m.MaxHeapBytes < m.HeapBytes {
			t.Fatalf("step %d: host figures %+v", m.Step, m)
		}
		for _, ph := range []string{memory.PhaseForwardBackward, memory.PhaseCommunication, memory.PhaseOptimizer} {
			if m.PhaseHeap[ph] <= 0 {
				t.Fatalf("step %d: no %s peak in %v", m.Step, ph, m.PhaseHeap)
			}
		}
		if m.Memory["device_params"] == 0 || m.GPU != nil {
			t.Fatalf("step %d: accounting %v, gpu %v", m.Step, m.Memory, m.GPU)
		}
	}
	if steps != 10 {
		t.Fatalf("%d train records, want 10", steps)
	}

	count := func(prefix string) (n int, last observer.LoggedEntry) {
		for _, e := range logs.All() {
			if strings.HasPrefix(e.Message, prefix) {
				n, last = n+1, e
			}
		}
		return n, last
	}
	// Every 4 steps (4, 8), and at the first step.
	if n, e := count("Memory - Allocated: "); n < 3 || !strings.Contains(e.Message, ", Free: 1.0 GiB, Max Used: ") {
		t.Fatalf("%d memory lines, last %q", n, e.Message)
	} else if f := e.ContextMap(); f["gpu"] != "no GPU: NVML not found (test)" || !strings.Contains(f["phase_peaks"].(string), "forward+backward ") {
		t.Fatalf("fields %v", f)
	}
	// Pressure starts at the first step and is repeated with the periodic lines, not every step.
	if n, e := count("host memory pressure: available memory 1.0 GiB is below memory.min_available 10% (1.6 GiB of 16.0 GiB)"); n != 3 {
		t.Fatalf("%d pressure warnings (want 3: steps 1, 4, 8), last %+v", n, e)
	}
	if p, why := mon.Pressure(); !p || !strings.Contains(why, "below memory.min_available") {
		t.Fatalf("Pressure() = %v, %q", p, why)
	}
	// One scoped measure per phase, on its first run only.
	for _, what := range []string{"first forward+backward", "first communication", "first optimizer"} {
		if n, _ := count("memory change: " + what + ":"); n != 1 {
			t.Errorf("%d %q measures, want 1", n, what)
		}
	}
}

func TestNoMemoryMonitor(t *testing.T) {
	rec := &recorder{}
	r := defaultRun()
	r.cfg.Epochs = 1
	tr := r.build(t, rec, nil)
	if _, err := tr.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, m := range rec.recs {
		if m.Kind == metrics.KindTrain && (m.HeapBytes == 0 || m.PhaseHeap != nil || m.MaxHeapBytes != 0) {
			t.Fatalf("without a monitor only heap and RSS: %+v", m)
		}
	}
}
