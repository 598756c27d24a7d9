package engine

import (
	"errors"
	"fmt"
	"sync"

	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
)

// Allocator is qvd's device allocator: a caching allocator in the manner of PyTorch's, so
// the activations of every micro-batch reuse the blocks of the one before instead of paying
// cudaMalloc's synchronisation each time, with the accounting the memory monitor reports —
// allocated (live blocks), reserved (blocks held from the device, live or cached) and their
// peaks.
//
// Blocks are cached by exact rounded size (512-byte granules), which is enough for a
// trainer whose every step allocates the same shapes. When the device is full, the cache is
// emptied and the allocation tried once more before the error goes up (wrapping
// memory.ErrOutOfMemory, which the trainer turns into a skipped micro-batch).
type Allocator struct {
	dev Device

	mu        sync.Mutex
	free      map[allocKey][]Buf // cached blocks by size class
	live      map[Ptr]int        // live block → its rounded bytes
	allocated int64
	reserved  int64
	maxAlloc  int64
	maxRes    int64
	allocs    int64 // calls to Alloc
	mallocs   int64 // calls that reached the device
	failAfter int64 // >0: the failAfter-th Alloc from now fails (test injection)
	failing   bool  // every Alloc fails until ClearFailure
}

type allocKey struct {
	bytes int
	t     DType
}

// granule is the rounding of block sizes: allocations of nearby sizes share a class.
const granule = 512

// NewAllocator wraps a device.
func NewAllocator(dev Device) *Allocator {
	return &Allocator{dev: dev, free: map[allocKey][]Buf{}, live: map[Ptr]int{}}
}

// Device is the device the allocator draws from.
func (a *Allocator) Device() Device { return a.dev }

// errInjected marks a failure made by FailAfter or FailAlways.
var errInjected = errors.New("injected by a test")

// Alloc returns a block of n elements of t, from the cache if one of its class is free.
func (a *Allocator) Alloc(n int, t DType) (Buf, error) {
	if n <= 0 || t.Size() == 0 {
		return Buf{}, fmt.Errorf("%w: allocation of %d elements of %v", ErrDevice, n, t)
	}
	bytes := (n*t.Size() + granule - 1) / granule * granule
	elems := bytes / t.Size()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.allocs++
	if a.failing || a.failAfter == 1 {
		a.failAfter = 0
		return Buf{}, fmt.Errorf("%w: %s of %v (%w)", memory.ErrOutOfMemory, memstat.FormatBytes(uint64(bytes)), t, errInjected)
	}
	if a.failAfter > 1 {
		a.failAfter--
	}
	k := allocKey{bytes, t}
	var b Buf
	if list := a.free[k]; len(list) > 0 {
		b = list[len(list)-1]
		a.free[k] = list[:len(list)-1]
	} else {
		var err error
		b, err = a.dev.Malloc(elems, t)
		if errors.Is(err, memory.ErrOutOfMemory) {
			a.emptyCacheLocked()
			b, err = a.dev.Malloc(elems, t)
		}
		if err != nil {
			return Buf{}, fmt.Errorf("allocating %s of %v on %s (%s allocated, %s reserved): %w",
				memstat.FormatBytes(uint64(bytes)), t, a.dev.Name(),
				memstat.FormatBytes(uint64(a.allocated)), memstat.FormatBytes(uint64(a.reserved)), err)
		}
		a.mallocs++
		a.reserved += int64(bytes)
		a.maxRes = max(a.maxRes, a.reserved)
	}
	a.live[b.Ptr] = bytes
	a.allocated += int64(bytes)
	a.maxAlloc = max(a.maxAlloc, a.allocated)
	return Buf{Ptr: b.Ptr, N: n, T: t}, nil
}

// Free returns a block to the cache. Freeing a block twice, or one the allocator did not
// make, panics: it is a bug that would corrupt another tensor.
func (a *Allocator) Free(b Buf) {
	if !b.Valid() {
		return
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	bytes, ok := a.live[b.Ptr]
	if !ok {
		panic(fmt.Sprintf("engine: free of a block the allocator does not hold (%#x)", b.Ptr))
	}
	delete(a.live, b.Ptr)
	a.allocated -= int64(bytes)
	k := allocKey{bytes, b.T}
	a.free[k] = append(a.free[k], Buf{Ptr: b.Ptr, N: bytes / b.T.Size(), T: b.T})
}

// EmptyCache gives every cached (free) block back to the device.
func (a *Allocator) EmptyCache() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.emptyCacheLocked()
}

func (a *Allocator) emptyCacheLocked() {
	for k, list := range a.free {
		for _, b := range list {
			a.dev.Release(b)
			a.reserved -= int64(k.bytes)
		}
		delete(a.free, k)
	}
}

// FailAfter makes the n-th Alloc from now fail with memory.ErrOutOfMemory (n >= 1; 0
// cancels): the injectable failure behind the tests of the out-of-memory skip.
func (a *Allocator) FailAfter(n int) {
	a.mu.Lock()
	a.failAfter = int64(max(n, 0))
	a.mu.Unlock()
}

// FailAlways makes every Alloc fail until ClearFailure.
func (a *Allocator) FailAlways() {
	a.mu.Lock()
	a.failing = true
	a.mu.Unlock()
}

// ClearFailure ends FailAfter and FailAlways.
func (a *Allocator) ClearFailure() {
	a.mu.Lock()
	a.failing, a.failAfter = false, 0
	a.mu.Unlock()
}

// Stats is the allocator's accounting, in bytes.
type Stats struct {
	Allocated, Reserved       int64 // live blocks; live and cached blocks held from the device
	MaxAllocated, MaxReserved int64
	Allocs, Mallocs           int64 // Alloc calls; of those, the ones that reached the device
}

// Stats returns the current accounting.
func (a *Allocator) Stats() Stats {
	a.mu.Lock()
	defer a.mu.Unlock()
	return Stats{Allocated: a.allocated, Reserved: a.reserved, MaxAllocated: a.maxAlloc, MaxReserved: a.maxRes, Allocs: a.allocs, Mallocs: a.mallocs}
}

// ResetPeaks starts the peaks again from the current figures (per phase or per step).
func (a *Allocator) ResetPeaks() {
	a.mu.Lock()
	a.maxAlloc, a.maxRes = a.allocated, a.reserved
	a.mu.Unlock()
}

// Close frees every block, live or cached.
func (a *Allocator) Close() {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.emptyCacheLocked()
	for p, bytes := range a.live {
		a.dev.Release(Buf{Ptr: p, N: bytes / 4, T: F32})
		a.reserved -= int64(bytes)
	}
	a.live = map[Ptr]int{}
	a.allocated = 0
}
