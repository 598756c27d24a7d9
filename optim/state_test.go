package optim

import (
	"errors"
	"runtime"
	"runtime/debug"
	"testing"

	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/memstat"
)

// TestStateOutsideHeap checks where the state lives by what the runtime and the kernel
// measure, not by the arena's own figures alone: building and stepping an optimizer leaves the
// Go heap as it was, raises the process's RSS by about the state's size, and Close gives those
// pages back to the kernel at once.
func TestStateOutsideHeap(t *testing.T) {
	const n = 8 << 20 // 64 MiB of Adam state, 16 MiB of 8-bit state
	p, g := make([]float32, n), make([]float32, n)
	fill(p, 1)
	fill(g, 1e-3)
	mem := memstat.NewReader()
	defer mem.Close()
	for name, cfg := range allConfigs() {
		// Give the heap's free pages back first, so that the scavenger does not lower the RSS
		// while it is being measured.
		debug.FreeOSMemory()
		a0, m0 := arena.Snapshot(), mem.Read()
		o, err := New(cfg, n)
		if err != nil {
			t.Fatal(err)
		}
		want := StateBytes(o)
		o.Step(p, g, 1e-3, 1) // touches every page of the state
		a1, m1 := arena.Snapshot(), mem.Read()
		if err := o.Close(); err != nil {
			t.Fatal(err)
		}
		a2, m2 := arena.Snapshot(), mem.Read()
		if got := a1.Current[arena.Optimizer] - a0.Current[arena.Optimizer]; got != want {
			t.Errorf("%s: %d bytes in arena.Optimizer, StateBytes %d", name, got, want)
		}
		if a2.Current[arena.Optimizer] != a0.Current[arena.Optimizer] || a2.Live != a0.Live {
			t.Errorf("%s: Close left %d bytes in %d blocks mapped", name,
				a2.Current[arena.Optimizer]-a0.Current[arena.Optimizer], a2.Live-a0.Live)
		}
		if want == 0 {
			continue
		}
		if d := int64(m1.HeapInUse) - int64(m0.HeapInUse); d > want/16 {
			t.Errorf("%s: the Go heap grew by %d bytes for %d bytes of state", name, d, want)
		}
		if d := int64(m1.RSS) - int64(m0.RSS); d < want*9/10 {
			t.Errorf("%s: RSS grew by %d bytes for %d bytes of state", name, d, want)
		}
		if d := int64(m1.RSS) - int64(m2.RSS); d < want*9/10 {
			t.Errorf("%s: Close gave back %d bytes of RSS for %d bytes of state", name, d, want)
		}
	}
}

// TestClosedOptimizer: the views State returns are the state until Close; afterwards State and
// ExportState return nothing rather than unmapped memory, and ImportState refuses.
func TestClosedOptimizer(t *testing.T) {
	for name, cfg := range allConfigs() {
		o := mustNew(t, cfg, 1000)
		o.Step(make([]float32, 1000), make([]float32, 1000), 1e-3, 1)
		st := ExportState(o)
		if err := ImportState(o, st); err != nil {
			t.Fatalf("%s: ImportState of its own state: %v", name, err)
		}
		o.Close()
		if s := o.State(); s != nil {
			t.Errorf("%s: State after Close = %d buffers", name, len(s))
		}
		if s := ExportState(o); s != nil {
			t.Errorf("%s: ExportState after Close = %d buffers", name, len(s))
		}
		if _, ok := o.(StateCodec); ok {
			if err := ImportState(o, st); !errors.Is(err, ErrClosed) {
				t.Errorf("%s: ImportState after Close: %v, want ErrClosed", name, err)
			}
		}
		if StateBytes(o) != 0 {
			t.Errorf("%s: StateBytes after Close = %d", name, StateBytes(o))
		}
	}
}

// TestNewOutOfMemory: a state the kernel cannot map is an error that says what was being
// mapped and wraps arena.ErrOutOfMemory, and leaves nothing behind: no mapping, no goroutine.
// Each buffer is 64 TiB, and two of them more than the 128 TiB of an x86-64 or arm64 process's
// address space, so at the latest the second mapping fails whatever the overcommit policy
// (with vm.overcommit_memory=1 the first succeeds, and must be unmapped again).
func TestNewOutOfMemory(t *testing.T) {
	if runtime.GOARCH != "amd64" && runtime.GOARCH != "arm64" {
		t.Skip("address-space size assumed for amd64 and arm64")
	}
	before := runtime.NumGoroutine()
	a0 := arena.Snapshot()
	for _, typ := range []string{TypeAdamW, TypeSGD, TypeAdamW8bit} {
		cfg := DefaultConfig()
		cfg.Type, cfg.Threads = typ, 4
		n := map[string]int{
			TypeAdamW:     1 << 44, // 64 TiB per moment
			TypeSGD:       1 << 45, // one buffer: it alone must exceed the address space
			TypeAdamW8bit: 1 << 46, // 64 TiB per moment's codes
		}[typ]
		o, err := New(cfg, n)
		if err == nil {
			o.Close()
			t.Fatalf("%s: New of %d parameters succeeded", typ, n)
		}
		if !errors.Is(err, arena.ErrOutOfMemory) {
			t.Errorf("%s: %v does not wrap arena.ErrOutOfMemory", typ, err)
		}
		t.Logf("%s: %v", typ, err)
	}
	if a := arena.Snapshot(); a.Total != a0.Total || a.Live != a0.Live {
		t.Errorf("failed New left %d bytes in %d blocks mapped", a.Total-a0.Total, a.Live-a0.Live)
	}
	waitGoroutines(t, before)
}
