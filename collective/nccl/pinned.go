//go:build cuda

package nccl

// gorgonia.org/cu v0.9.4 frees pinned host memory (MemFreeHost) but cannot allocate it.

/*
#cgo LDFLAGS: -lcuda
#cgo linux LDFLAGS: -L/usr/local/cuda/lib64
#cgo linux CFLAGS: -I/usr/local/cuda/include
#include <cuda.h>
*/
import "C"

import (
	"fmt"
	"unsafe"

	"gorgonia.org/cu"
)

// pinned is page-locked host memory (cuMemAllocHost) in the current context, so the copies
// between it and the device are truly asynchronous.
type pinned struct {
	p unsafe.Pointer
	n int64
}

// alloc makes s hold n bytes, freeing what it held; the caller knows no copy still uses it.
func (s *pinned) alloc(n int64) error {
	s.free()
	var p unsafe.Pointer
	if r := C.cuMemAllocHost(&p, C.size_t(n)); r != C.CUDA_SUCCESS {
		return fmt.Errorf("cuMemAllocHost(%d bytes): CUresult %d", n, int(r))
	}
	s.p, s.n = p, n
	return nil
}

func (s *pinned) free() {
	if s.p != nil {
		_ = cu.MemFreeHost(s.p)
	}
	s.p, s.n = nil, 0
}

// bytes is the whole allocation.
func (s *pinned) bytes() []byte {
	if s.p == nil {
		return nil
	}
	return unsafe.Slice((*byte)(s.p), s.n)
}

// at is the address of byte off.
func (s *pinned) at(off int64) unsafe.Pointer { return unsafe.Add(s.p, off) }
