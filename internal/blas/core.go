//go:build cgo

package blas

/*
#cgo LDFLAGS: -lopenblas -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

void openblas_set_num_threads(int);
int openblas_get_num_threads(void);
char *openblas_get_corename(void);

// qvd_select_core makes a DYNAMIC_ARCH OpenBLAS load the kernels of another core type, as
// OPENBLAS_CORETYPE does at start-up, by running its dynamic initialisation again. It returns
// 0 on success, -1 where this OpenBLAS has no dynamic core selection.
static int qvd_select_core(const char *name) {
	void (*quit)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "gotoblas_dynamic_quit");
	void (*init)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "gotoblas_dynamic_init");
	if (!quit || !init) return -1;
	setenv("OPENBLAS_CORETYPE", name, 1);
	quit();
	init();
	return 0;
}
*/
import "C"

import (
	"os"
	"sync"
	"unsafe"

	"golang.org/x/sys/cpu"
)

// SetThreads sets the number of threads OpenBLAS uses (n >= 1).
func SetThreads(n int) {
	if n >= 1 {
		C.openblas_set_num_threads(C.int(n))
	}
}

// Threads reports OpenBLAS's thread count.
func Threads() int { return int(C.openblas_get_num_threads()) }

// CoreName is the core type whose kernels OpenBLAS runs ("Haswell", "SkylakeX", ...).
func CoreName() string { return C.GoString(C.openblas_get_corename()) }

var selectOnce sync.Once

// SelectCore makes sure OpenBLAS runs AVX-512 kernels where the CPU has them, and returns the
// core name whose kernels it runs.
//
// OpenBLAS 0.3.21 (Debian 12's) can fall back to its Haswell (AVX2) or Zen kernels on AVX-512
// CPUs it does not know; its SkylakeX kernels run on every CPU with AVX-512 F, BW, DQ and VL
// and, measured on the 2-core development machine (AMD EPYC, AVX-512), twice as fast on the
// small GEMMs of a training step (a 64×256×784 product: 60 GFLOP/s against 131, one thread).
// So where the CPU has those and OpenBLAS chose Haswell or Zen by itself, SelectCore switches
// to SkylakeX. A core the user chose with OPENBLAS_CORETYPE is kept as it is. It runs once per
// process, before the first GEMM of the engine; it must not run while another goroutine is in
// OpenBLAS.
func SelectCore() string {
	selectOnce.Do(func() {
		if _, set := os.LookupEnv("OPENBLAS_CORETYPE"); set {
			return
		}
		x := cpu.X86
		if !(x.HasAVX512F && x.HasAVX512BW && x.HasAVX512DQ && x.HasAVX512VL) {
			return
		}
		switch CoreName() {
		case "Haswell", "Zen":
			name := C.CString("SkylakeX")
			defer C.free(unsafe.Pointer(name))
			C.qvd_select_core(name)
			// Keep the environment as the user left it: children choose for themselves.
			os.Unsetenv("OPENBLAS_CORETYPE")
		}
	})
	return CoreName()
}
