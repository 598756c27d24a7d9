//go:build cuda

package pinned

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
)

// Buffer is one allocation of pinned memory in the CUDA context current on the calling
// thread; the zero Buffer holds nothing. It is not safe for concurrent use, and the caller
// must know that no queued copy still uses the memory when it calls Alloc or Free.
type Buffer struct {
	p unsafe.Pointer
	n int
}

// Alloc makes b hold n bytes, freeing what it held first.
func (b *Buffer) Alloc(n int) error {
	if n <= 0 {
		return fmt.Errorf("pinned: allocation of %d bytes", n)
	}
	b.Free()
	var p unsafe.Pointer
	if r := C.cuMemAllocHost(&p, C.size_t(n)); r != C.CUDA_SUCCESS {
		return fmt.Errorf("cuMemAllocHost(%d bytes): CUresult %d", n, int(r))
	}
	b.p, b.n = p, n
	return nil
}

// Free returns the memory to the driver. Safe on a Buffer that holds nothing.
func (b *Buffer) Free() {
	if b.p != nil {
		C.cuMemFreeHost(b.p)
		b.p, b.n = nil, 0
	}
}

// Len is the size of the allocation in bytes (0 if none).
func (b *Buffer) Len() int { return b.n }

// Ptr is the allocation's address, nil if none: what the driver's copy calls take.
func (b *Buffer) Ptr() unsafe.Pointer { return b.p }

// At is the address of byte off of the allocation.
func (b *Buffer) At(off int) unsafe.Pointer {
	if off < 0 || off > b.n {
		panic(fmt.Sprintf("pinned: offset %d outside an allocation of %d bytes", off, b.n))
	}
	return unsafe.Add(b.p, off)
}

// Bytes is the first n bytes of the allocation as a slice (nil if it holds nothing).
func (b *Buffer) Bytes(n int) []byte {
	if b.p == nil {
		return nil
	}
	if n < 0 || n > b.n {
		panic(fmt.Sprintf("pinned: %d bytes of an allocation of %d", n, b.n))
	}
	return unsafe.Slice((*byte)(b.p), n)
}
