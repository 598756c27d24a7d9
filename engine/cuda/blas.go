//go:build cuda

package cuda

import (
	"fmt"
	"unsafe"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/dynlib"
)

// cuBLAS's enum values (cublas_api.h, library_types.h); they have not changed since CUDA 11.
const (
	cublasOpN           = 0
	cublasOpT           = 1
	cublasCompute32F    = 68 // CUBLAS_COMPUTE_32F: fp32 accumulation, no TF32
	cublasGemmDefault   = -1
	cublasDefaultMath   = 0
	cudaR32F            = 0
	cudaR16F            = 2
	cudaR16BF           = 14
	cublasStatusSuccess = 0
)

// CuBLASSpec is where Open looks for cuBLAS: $QVD_CUBLAS_LIBRARY, then the sonames of CUDA
// 13, 12 and 11, then the pip wheels' copies.
var CuBLASSpec = dynlib.Spec{
	What:  "cuBLAS",
	Env:   "QVD_CUBLAS_LIBRARY",
	Names: []string{"libcublas.so.13", "libcublas.so.12", "libcublas.so.11"},
	Globs: dynlib.PipGlobs("libcublas.so.*"),
}

// cublas is a handle of a cuBLAS loaded at run time; its calls need the device's context
// current on the calling thread, as every Device method makes it.
type cublas struct {
	lib    *dynlib.Lib
	handle uintptr

	create      func(handle *uintptr) int32
	destroy     func(handle uintptr) int32
	setStream   func(handle, stream uintptr) int32
	setMathMode func(handle uintptr, mode int32) int32
	gemmEx      func(handle uintptr, transa, transb, m, n, k int32, alpha unsafe.Pointer,
		a uintptr, atype, lda int32, b uintptr, btype, ldb int32, beta unsafe.Pointer,
		c uintptr, ctype, ldc int32, compute, algo int32) int32
	gemmStridedBatchedEx func(handle uintptr, transa, transb, m, n, k int32, alpha unsafe.Pointer,
		a uintptr, atype, lda int32, strideA int64, b uintptr, btype, ldb int32, strideB int64, beta unsafe.Pointer,
		c uintptr, ctype, ldc int32, strideC int64, batch, compute, algo int32) int32
}

// openCuBLAS loads cuBLAS, creates a handle and binds it to stream.
func openCuBLAS(stream uintptr) (*cublas, error) {
	lib, err := dynlib.Open(CuBLASSpec)
	if err != nil {
		return nil, err
	}
	b := &cublas{lib: lib}
	for _, s := range []struct {
		fn   any
		name string
	}{
		{&b.create, "cublasCreate_v2"},
		{&b.destroy, "cublasDestroy_v2"},
		{&b.setStream, "cublasSetStream_v2"},
		{&b.setMathMode, "cublasSetMathMode"},
		{&b.gemmEx, "cublasGemmEx"},
		{&b.gemmStridedBatchedEx, "cublasGemmStridedBatchedEx"},
	} {
		if err := lib.Bind(s.fn, s.name); err != nil {
			lib.Close()
			return nil, err
		}
	}
	if err := b.status("cublasCreate_v2", b.create(&b.handle)); err != nil {
		lib.Close()
		return nil, err
	}
	err = b.status("cublasSetStream_v2", b.setStream(b.handle, stream))
	if err == nil {
		// The default already, unless NVIDIA_TF32_OVERRIDE says otherwise: fp32 GEMMs stay fp32.
		err = b.status("cublasSetMathMode", b.setMathMode(b.handle, cublasDefaultMath))
	}
	if err != nil {
		b.close()
		return nil, err
	}
	return b, nil
}

func (b *cublas) close() error {
	if b == nil {
		return nil
	}
	var err error
	if b.handle != 0 {
		err = b.status("cublasDestroy_v2", b.destroy(b.handle))
		b.handle = 0
	}
	b.lib.Close()
	return err
}

// status turns a cublasStatus_t into an error naming the call and the library's file.
func (b *cublas) status(call string, s int32) error {
	if s == cublasStatusSuccess {
		return nil
	}
	return fmt.Errorf("%w: %s (%s) returned %s", engine.ErrDevice, call, b.lib.Path, cublasStatusName(s))
}

func cublasStatusName(s int32) string {
	switch s {
	case 1:
		return "CUBLAS_STATUS_NOT_INITIALIZED"
	case 3:
		return "CUBLAS_STATUS_ALLOC_FAILED"
	case 7:
		return "CUBLAS_STATUS_INVALID_VALUE"
	case 8:
		return "CUBLAS_STATUS_ARCH_MISMATCH"
	case 11:
		return "CUBLAS_STATUS_MAPPING_ERROR"
	case 13:
		return "CUBLAS_STATUS_EXECUTION_FAILED"
	case 14:
		return "CUBLAS_STATUS_INTERNAL_ERROR"
	case 15:
		return "CUBLAS_STATUS_NOT_SUPPORTED"
	case 16:
		return "CUBLAS_STATUS_LICENSE_ERROR"
	}
	return fmt.Sprintf("cublasStatus %d", s)
}

// cudaDataType is cuBLAS's name for a buffer type.
func cudaDataType(t engine.DType) int32 {
	switch t {
	case engine.F16:
		return cudaR16F
	case engine.BF16:
		return cudaR16BF
	}
	return cudaR32F
}
