package optim

import (
	"fmt"

	"github.com/qvd/qvd/internal/arena"
)

// stateMem is the memory an optimizer's state lives in: blocks of internal/arena, category
// arena.Optimizer, mapped by New and unmapped by Close. The state is O(parameters) (8 bytes
// per parameter for Adam) and lives as long as the optimizer, which is what the arena is for:
// outside the Go heap, the garbage collector neither scans it nor counts it towards the heap
// goal, the scavenger never returns its pages to the kernel behind the optimizer's back, and
// blocks of 2 MiB and more are advised MADV_HUGEPAGE, so a step over it takes one TLB entry
// and, the first time, one page fault per 2 MiB rather than per 4 KiB (see bench_test.go for
// what that costs where the kernel's transparent huge pages are in "madvise" mode).
type stateMem struct {
	blocks []*arena.Block
	err    error // the first failed mapping; later ones are not tried
}

// float32s maps n zeroed float32s (nil for n == 0, or once a mapping has failed); what names
// the buffer in the error.
func (s *stateMem) float32s(n int, what string) []float32 {
	if n == 0 || s.err != nil {
		return nil
	}
	b, xs, err := arena.Float32s(n, arena.Optimizer)
	if err != nil {
		s.err = fmt.Errorf("%s (%d float32s): %w", what, n, err)
		return nil
	}
	s.blocks = append(s.blocks, b)
	return xs
}

// bytes maps n zeroed bytes, as float32s does.
func (s *stateMem) bytes(n int, what string) []byte {
	if n == 0 || s.err != nil {
		return nil
	}
	b, err := arena.Alloc(n, arena.Optimizer)
	if err != nil {
		s.err = fmt.Errorf("%s (%d bytes): %w", what, n, err)
		return nil
	}
	s.blocks = append(s.blocks, b)
	return b.Bytes()
}

// failed returns the first mapping's error, if any, having unmapped the blocks that were
// mapped: a constructor calls it after its last allocation.
func (s *stateMem) failed() error {
	if s.err != nil {
		s.free()
	}
	return s.err
}

// free unmaps every block; the slices handed out must not be used afterwards.
func (s *stateMem) free() {
	for _, b := range s.blocks {
		b.Free()
	}
	s.blocks = nil
}
