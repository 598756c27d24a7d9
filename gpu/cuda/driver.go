//go:build cuda

package cuda

// The two driver calls gorgonia.org/cu v0.9.4 does not wrap: pinned host allocation, and a
// module load that returns the JIT's error log (cu's LoadDataEx would hand the driver a Go
// pointer inside Go memory, which cgo's pointer check rejects).

/*
#cgo LDFLAGS: -lcuda
#cgo linux LDFLAGS: -L/usr/local/cuda/lib64
#cgo linux CFLAGS: -I/usr/local/cuda/include
#include <cuda.h>
#include <stdlib.h>

static CUresult qvdJITLog(const void *image, char *log, size_t n) {
	CUjit_option opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
	void *vals[2] = {log, (void *)n};
	CUmodule m;
	CUresult r = cuModuleLoadDataEx(&m, image, 2, opts, vals);
	if (r == CUDA_SUCCESS) cuModuleUnload(m);
	return r;
}
*/
import "C"

import (
	"fmt"
	"strings"
	"unsafe"
)

// driverError is a CUresult from one of the calls above.
type driverError struct {
	call string
	code int
}

func (e driverError) Error() string { return fmt.Sprintf("%s: CUresult %d", e.call, e.code) }

// pinned is page-locked host memory (cuMemAllocHost), which the copy engines read and write
// directly, so an asynchronous copy from it really is asynchronous.
type pinned struct {
	p unsafe.Pointer
	n int
}

// alloc makes s hold n bytes, freeing what it held. The caller must know no copy still uses it.
func (s *pinned) alloc(n int) error {
	s.free()
	var p unsafe.Pointer
	if r := C.cuMemAllocHost(&p, C.size_t(n)); r != C.CUDA_SUCCESS {
		return driverError{fmt.Sprintf("cuMemAllocHost(%d bytes)", n), int(r)}
	}
	s.p, s.n = p, n
	return nil
}

func (s *pinned) free() {
	if s.p != nil {
		C.cuMemFreeHost(s.p)
		s.p, s.n = nil, 0
	}
}

func (s *pinned) bytes(n int) []byte { return unsafe.Slice((*byte)(s.p), n) }

// jitLog loads image once more to get the JIT compiler's error log, after cuModuleLoadData
// failed: the diagnostic an error at Open should carry.
func jitLog(image string) string {
	const n = 1 << 14
	log := (*C.char)(C.calloc(n, 1))
	defer C.free(unsafe.Pointer(log))
	img := C.CString(image)
	defer C.free(unsafe.Pointer(img))
	C.qvdJITLog(unsafe.Pointer(img), log, n)
	return strings.TrimSpace(C.GoString(log))
}
