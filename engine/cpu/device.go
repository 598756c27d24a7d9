package cpu

/*
#cgo CFLAGS: -O3 -std=gnu11
#cgo LDFLAGS: -lopenblas -lm
#include "kernels.h"
*/
import "C"

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/arena"
	"github.com/qvd/qvd/internal/blas"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/offload"
)

// Options configure a Device.
type Options struct {
	// Pool runs the parallel passes; nil makes the Device start its own with Threads workers
	// (0: one per core the Go runtime uses). The trainer passes the pool its optimizer runs on,
	// so one set of goroutines owns the cores.
	Pool    *offload.Pool
	Threads int
	// Limit caps the memory the process holds outside the Go heap (every internal/arena block:
	// parameters, gradients, optimizer state, buffers and this device's activations; 0: none):
	// a Malloc that would pass it fails with memory.ErrOutOfMemory, which the trainer turns
	// into a skipped micro-batch and, repeated, a smaller one (memory.limit).
	Limit uint64
}

// Device is the CPU backend. Buffers are blocks of internal/arena (outside the Go heap) or
// views of the caller's memory (View); operations run at once, in the calling goroutine and
// the pool's, so Sync only reports the first error since the last Sync. A Device is driven by
// one goroutine at a time (the engine's); it is not safe for concurrent use.
type Device struct {
	pool     *offload.Pool
	ownPool  bool
	threads  int
	limit    uint64
	corename string

	mu   sync.Mutex // guards mem, used (Malloc/Release may come from an allocator on another goroutine)
	mem  map[engine.Ptr]region
	used uint64
	err  error

	// Parallel passes, kept so that handing one to the pool allocates nothing.
	gemm   gemmPass
	conv   convPass
	unary  unaryPass
	pool2  poolPass
	adam   adamPass
	halves halfScratch
}

// region is one allocation or registered view.
type region struct {
	b     []byte
	block *arena.Block // nil for a view
	views int          // a view's open View calls: two nets may view the same parameters
}

var _ engine.Device = (*Device)(nil)

// New opens the CPU device. It sets OpenBLAS to one thread (the pool's goroutines call it in
// parallel, each on its own part of a product) and selects its fastest kernels for this CPU.
func New(o Options) *Device {
	d := &Device{pool: o.Pool, limit: o.Limit, mem: map[engine.Ptr]region{}}
	if d.pool == nil {
		d.pool, d.ownPool = offload.NewPool(o.Threads), true
	}
	d.threads = d.pool.Threads()
	blas.SetThreads(1)
	d.corename = blas.SelectCore()
	return d
}

// Name says what runs the kernels.
func (d *Device) Name() string {
	return fmt.Sprintf("cpu (%d threads, OpenBLAS %s kernels, %s)", d.threads, d.corename, accelerated())
}

// Threads is the number of goroutines the device's passes run on.
func (d *Device) Threads() int { return d.threads }

// TotalMemory is the configured limit (0: none): the whole budget, model states included.
func (d *Device) TotalMemory() uint64 { return d.limit }

// Malloc maps a block outside the Go heap (internal/arena, accounted as activations).
func (d *Device) Malloc(n int, t engine.DType) (engine.Buf, error) {
	if n <= 0 || t.Size() == 0 {
		return engine.Buf{}, fmt.Errorf("%w: malloc of %d elements of %v", engine.ErrDevice, n, t)
	}
	bytes := uint64(n * t.Size())
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.limit > 0 {
		if held := uint64(arena.Snapshot().Total); held+bytes > d.limit {
			return engine.Buf{}, fmt.Errorf("%w: %s on the CPU device: %s is held outside the Go heap, of the %s limit (memory.limit)", memory.ErrOutOfMemory,
				memstat.FormatBytes(bytes), memstat.FormatBytes(held), memstat.FormatBytes(d.limit))
		}
	}
	blk, err := arena.Alloc(int(bytes), arena.Activations)
	if err != nil {
		if errors.Is(err, arena.ErrOutOfMemory) {
			return engine.Buf{}, fmt.Errorf("%w: %v", memory.ErrOutOfMemory, err)
		}
		return engine.Buf{}, fmt.Errorf("%w: %v", engine.ErrDevice, err)
	}
	p := engine.Ptr(blk.Addr())
	d.mem[p] = region{b: blk.Bytes(), block: blk}
	d.used += bytes
	return engine.Buf{Ptr: p, N: n, T: t}, nil
}

// Release unmaps a block Malloc made.
func (d *Device) Release(b engine.Buf) {
	d.mu.Lock()
	defer d.mu.Unlock()
	r, ok := d.mem[b.Ptr]
	if !ok || r.block == nil {
		return
	}
	d.used -= uint64(r.block.Len())
	delete(d.mem, b.Ptr)
	r.block.Free()
}

// View makes the caller's memory a device buffer of float32 without copying: on the CPU the
// host is the device, so the trainer's parameters and the ZeRO engine's gradient buckets are
// used in place. The caller keeps x alive and unchanged in length while the view is in use,
// and ends it with Unview.
func (d *Device) View(x []float32) engine.Buf {
	if len(x) == 0 {
		return engine.Buf{}
	}
	b := unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 4*len(x))
	p := engine.Ptr(uintptr(unsafe.Pointer(&x[0])))
	d.mu.Lock()
	defer d.mu.Unlock()
	if r, ok := d.mem[p]; ok {
		if r.block != nil {
			// A view of one of our own blocks (the allocator's memory seen as a slice).
			return engine.Buf{Ptr: p, N: len(x), T: engine.F32}
		}
		if len(r.b) < len(b) {
			r.b = b
		}
		r.views++
		d.mem[p] = r
		return engine.Buf{Ptr: p, N: len(x), T: engine.F32}
	}
	d.mem[p] = region{b: b, views: 1}
	return engine.Buf{Ptr: p, N: len(x), T: engine.F32}
}

// Unview ends a view made by View (nothing for other buffers). Views of the same memory are
// counted: the memory stops being a device buffer when the last one ends (a net rebuilt at a
// smaller micro-batch views the parameters before the old one closes).
func (d *Device) Unview(b engine.Buf) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r, ok := d.mem[b.Ptr]; ok && r.block == nil {
		if r.views--; r.views > 0 {
			d.mem[b.Ptr] = r
			return
		}
		delete(d.mem, b.Ptr)
	}
}

// Float32s is the memory of an F32 buffer as a slice (nil, with the error latched, for a
// bad view): how the engine's host side reads a device buffer without a copy.
func (d *Device) Float32s(b engine.Buf) []float32 { return d.f32(b) }

// fail latches the first error.
func (d *Device) fail(format string, args ...any) {
	if d.err == nil {
		d.err = fmt.Errorf("%w: cpu: "+format, append([]any{engine.ErrDevice}, args...)...)
	}
}

// check latches an error unless ok, and reports whether to go on.
func (d *Device) check(ok bool, format string, args ...any) bool {
	if !ok {
		d.fail(format, args...)
	}
	return ok && d.err == nil
}

// raw resolves a view to its bytes, or nil with the error latched.
func (d *Device) raw(b engine.Buf) []byte {
	if d.err != nil {
		return nil
	}
	if !b.Valid() {
		d.fail("invalid buffer %+v", b)
		return nil
	}
	d.mu.Lock()
	r, ok := d.mem[b.Ptr]
	d.mu.Unlock()
	sz := b.T.Size()
	switch {
	case !ok:
		d.fail("no allocation at %#x", b.Ptr)
		return nil
	case b.Off < 0 || b.N < 0 || (b.Off+b.N)*sz > len(r.b):
		d.fail("view [%d, %d) of %v outside an allocation of %d bytes", b.Off, b.Off+b.N, b.T, len(r.b))
		return nil
	}
	return r.b[b.Off*sz : (b.Off+b.N)*sz]
}

func (d *Device) f32(b engine.Buf) []float32 {
	if b.T != engine.F32 {
		if d.err == nil {
			d.fail("%v buffer where f32 is needed", b.T)
		}
		return nil
	}
	r := d.raw(b)
	if r == nil {
		return nil
	}
	if len(r) == 0 {
		return []float32{}
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&r[0])), len(r)/4)
}

func (d *Device) u16(b engine.Buf) []uint16 {
	r := d.raw(b)
	if r == nil || len(r) == 0 {
		return nil
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(&r[0])), len(r)/2)
}

func (d *Device) i32(b engine.Buf) []int32 {
	if b.T != engine.I32 {
		if d.err == nil {
			d.fail("%v buffer where i32 is needed", b.T)
		}
		return nil
	}
	r := d.raw(b)
	if r == nil || len(r) == 0 {
		return nil
	}
	return unsafe.Slice((*int32)(unsafe.Pointer(&r[0])), len(r)/4)
}

// Sync returns the first error since the last Sync: every operation has already run.
func (d *Device) Sync() error {
	err := d.err
	d.err = nil
	return err
}

// Close frees every block and stops the device's own pool.
func (d *Device) Close() error {
	d.mu.Lock()
	for p, r := range d.mem {
		if r.block != nil {
			r.block.Free()
		}
		delete(d.mem, p)
	}
	d.used = 0
	d.mu.Unlock()
	d.halves.free()
	if d.ownPool {
		d.pool.Close()
	}
	return nil
}

// fptr is the C address of a float slice's first element (nil for an empty one).
func fptr(x []float32) *C.float {
	if len(x) == 0 {
		return nil
	}
	return (*C.float)(unsafe.Pointer(&x[0]))
}

func iptr(x []int32) *C.int32_t {
	if len(x) == 0 {
		return nil
	}
	return (*C.int32_t)(unsafe.Pointer(&x[0]))
}
