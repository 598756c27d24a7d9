//go:build cuda

package cuda

// The driver call gorgonia.org/cu v0.9.4 does not wrap usefully: a module load that returns
// the JIT's error log (cu's LoadDataEx would hand the driver a Go pointer inside Go memory,
// which cgo's pointer check rejects). Pinned host memory, which cu cannot allocate either, is
// internal/pinned.

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
	"strings"
	"unsafe"
)

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
