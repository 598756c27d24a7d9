package arena

import (
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/qvd/qvd/internal/memstat"
)

// Category says what a block holds, for the accounting.
type Category uint8

// Categories of model state and workspace.
const (
	Params      Category = iota // working-precision parameters
	Grads                       // gradients (full, shard, or in flight)
	Master                      // fp32 master weights
	Optimizer                   // optimizer state (moments, momentum, 8-bit codes)
	Buffers                     // communication buckets and transfer staging
	Activations                 // activation and backward workspace (the CPU device's allocator)
	Data                        // datasets
	numCategories
)

func (c Category) String() string {
	switch c {
	case Params:
		return "params"
	case Grads:
		return "grads"
	case Master:
		return "master"
	case Optimizer:
		return "optimizer"
	case Buffers:
		return "buffers"
	case Activations:
		return "activations"
	case Data:
		return "data"
	}
	return fmt.Sprintf("Category(%d)", uint8(c))
}

// Categories lists every category, in the order Stats reports them.
func Categories() []Category {
	out := make([]Category, numCategories)
	for i := range out {
		out[i] = Category(i)
	}
	return out
}

// hugePage is the size of an x86-64 and arm64 transparent huge page.
const hugePage = 2 << 20

// pageSize is the base page size (mappings are whole pages).
var pageSize = unix.Getpagesize()

// ErrOutOfMemory is returned when the kernel refuses a mapping (ENOMEM).
var ErrOutOfMemory = errors.New("arena: out of memory")

// Block is one mapping.
type Block struct {
	mem  []byte  // the usable bytes (what Bytes returns)
	base uintptr // the mapping, for munmap
	size uintptr
	cat  Category
	n    int // bytes asked for (the accounting)
}

var acct struct {
	sync.Mutex
	cur, peak [numCategories]int64
	total     int64
	peakTotal int64
	blocks    int64
}

// Alloc maps a zeroed block of n bytes (n > 0) for category c.
func Alloc(n int, c Category) (*Block, error) {
	if n <= 0 {
		return nil, fmt.Errorf("arena: allocation of %d bytes", n)
	}
	if c >= numCategories {
		return nil, fmt.Errorf("arena: unknown category %d", c)
	}
	size := (n + pageSize - 1) &^ (pageSize - 1)
	huge := size >= hugePage
	mapLen := size
	if huge {
		// The start is aligned, the length is not rounded up: the kernel backs the whole
		// 2 MiB ranges with huge pages and the tail with base pages, so a block costs its
		// size in RSS, not up to 2 MiB more.
		mapLen = size + hugePage // room to align the start to 2 MiB
	}
	base, err := mmap(mapLen)
	if err != nil {
		if errors.Is(err, unix.ENOMEM) {
			return nil, fmt.Errorf("%w: mapping %s for %s: %v", ErrOutOfMemory, memstat.FormatBytes(uint64(n)), c, err)
		}
		return nil, fmt.Errorf("arena: mapping %s for %s: %w", memstat.FormatBytes(uint64(n)), c, err)
	}
	if huge {
		// Trim the unaligned head and the tail so the block is 2 MiB-aligned and the kernel
		// can back it with huge pages from its first byte.
		skip := (hugePage - base%hugePage) % hugePage
		if skip > 0 {
			munmap(base, skip)
		}
		if tail := uintptr(mapLen) - skip - uintptr(size); tail > 0 {
			munmap(base+skip+uintptr(size), tail)
		}
		base += skip
		// Advice only: where THP is off, or the kernel refuses, the pages are 4 KiB.
		_, _, _ = unix.Syscall(unix.SYS_MADVISE, base, uintptr(size), unix.MADV_HUGEPAGE)
	}
	mem := bytesAt(base, size)
	b := &Block{mem: mem[:n:n], base: base, size: uintptr(size), cat: c, n: n}
	acct.Lock()
	acct.cur[c] += int64(n)
	acct.peak[c] = max(acct.peak[c], acct.cur[c])
	acct.total += int64(n)
	acct.peakTotal = max(acct.peakTotal, acct.total)
	acct.blocks++
	acct.Unlock()
	return b, nil
}

// Bytes is the block's memory.
func (b *Block) Bytes() []byte { return b.mem }

// Float32s views the block as float32s (len = bytes/4).
func (b *Block) Float32s() []float32 {
	if len(b.mem) < 4 {
		return nil
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&b.mem[0])), len(b.mem)/4)
}

// Uint16s views the block as uint16 words (len = bytes/2).
func (b *Block) Uint16s() []uint16 {
	if len(b.mem) < 2 {
		return nil
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(&b.mem[0])), len(b.mem)/2)
}

// Addr is the address of the block's first byte.
func (b *Block) Addr() uintptr { return uintptr(unsafe.Pointer(&b.mem[0])) }

// Len is the block's size in bytes, as asked for.
func (b *Block) Len() int { return b.n }

// Category is what the block was allocated for.
func (b *Block) Category() Category { return b.cat }

// Free unmaps the block; safe on nil and twice.
func (b *Block) Free() {
	if b == nil || b.base == 0 {
		return
	}
	munmap(b.base, b.size)
	b.base, b.mem = 0, nil
	acct.Lock()
	acct.cur[b.cat] -= int64(b.n)
	acct.total -= int64(b.n)
	acct.blocks--
	acct.Unlock()
}

// Float32s maps a zeroed block of n float32s for category c and returns it with its slice
// (nil slice for n == 0).
func Float32s(n int, c Category) (*Block, []float32, error) {
	if n == 0 {
		return nil, nil, nil
	}
	b, err := Alloc(4*n, c)
	if err != nil {
		return nil, nil, err
	}
	return b, b.Float32s(), nil
}

// Stats is the accounting: bytes mapped now and their peak, per category and in all.
type Stats struct {
	Current, Peak          map[Category]int64
	Total, PeakTotal, Live int64 // Live: blocks mapped
}

// Snapshot returns the accounting.
func Snapshot() Stats {
	acct.Lock()
	defer acct.Unlock()
	s := Stats{Current: map[Category]int64{}, Peak: map[Category]int64{}, Total: acct.total, PeakTotal: acct.peakTotal, Live: acct.blocks}
	for c := Category(0); c < numCategories; c++ {
		s.Current[c], s.Peak[c] = acct.cur[c], acct.peak[c]
	}
	return s
}

// ResetPeaks starts the peaks again from the current figures.
func ResetPeaks() {
	acct.Lock()
	acct.peak = acct.cur
	acct.peakTotal = acct.total
	acct.Unlock()
}

// mmap maps n bytes of anonymous, private, zeroed memory. The raw system call: x/sys's Mmap
// keeps its own table of mappings and refuses to unmap part of one, which the huge-page
// alignment needs.
func mmap(n int) (uintptr, error) {
	p, _, errno := unix.Syscall6(unix.SYS_MMAP, 0, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS, ^uintptr(0), 0)
	if errno != 0 {
		return 0, errno
	}
	return p, nil
}

func munmap(p, n uintptr) {
	// munmap of a range this package mapped fails only on a bad argument: a bug, not a
	// condition a caller could handle.
	if _, _, errno := unix.Syscall(unix.SYS_MUNMAP, p, n, 0); errno != 0 {
		panic(fmt.Sprintf("arena: munmap(%#x, %d): %v", p, n, errno))
	}
}

// bytesAt is the n bytes at address p, which this package mapped: memory the Go runtime
// does not manage, so the address cannot move or be collected. (Written through a slice
// header because vet's unsafeptr check cannot know that about a uintptr.)
func bytesAt(p uintptr, n int) []byte {
	h := struct {
		data     uintptr
		len, cap int
	}{p, n, n}
	return *(*[]byte)(unsafe.Pointer(&h))
}
