//go:build cuda

package cuda

// Tests that need the emulated driver (internal/cudaemu, scripts/gpu/emulate.sh): they skip on
// a GPU. Each planted bug — a mistake engine/cuda could make — must be caught: a kernel's
// arguments in the wrong order, a kernel indexing past its buffer, a GEMM's leading dimension
// too large for its buffer, a host read of an asynchronous copy before its wait. A fault
// loses the CUDA context for good (as on a GPU), so those run in a child process.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cuda/kernels"
	"github.com/qvd/qvd/internal/cudaemu"
)

func emulator(t *testing.T) *cudaemu.Driver {
	t.Helper()
	drv, err := cudaemu.Open()
	if errors.Is(err, cudaemu.ErrNotEmulated) {
		t.Skipf("not under the emulated driver: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { drv.Close() })
	return drv
}

// TestEmuKernels: the emulator was built from the kernels.cu whose PTX this package embeds
// (Open checked the sha256), and has exactly the entry points engine/cuda looks up.
func TestEmuKernels(t *testing.T) {
	drv := emulator(t)
	got, want := drv.Kernels(), kernels.Names()
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("emulated kernels %v, engine/cuda wants %v", got, want)
	}
}

// TestEmuMissingSync: a DownloadAsync read before WaitDownloads sees stale memory under the
// emulator's delay; after the wait, the data.
func TestEmuMissingSync(t *testing.T) {
	drv := emulator(t)
	b, err := dev.Malloc(1000, engine.F32)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Release(b)
	dev.Fill(b, 7)
	drv.SetDelay(20000)
	defer drv.SetDelay(0)
	got := make([]float32, 1000)
	dev.DownloadAsync(got, b)
	if got[0] == 7 || got[999] == 7 {
		t.Errorf("DownloadAsync's destination held the data before WaitDownloads: the copy is not asynchronous")
	}
	if err := dev.WaitDownloads(); err != nil {
		t.Fatal(err)
	}
	if got[0] != 7 || got[999] != 7 {
		t.Fatalf("after WaitDownloads: %v … %v, want 7", got[0], got[999])
	}
}

// planted are bugs, each made through engine/cuda's own launch and cuBLAS paths, with what
// the emulator's diagnostic must say.
var planted = map[string]struct {
	bug  func(t *testing.T)
	want []string
}{
	"launch-argument-order": {
		func(t *testing.T) {
			b := mustMalloc(t, 1000, engine.F32)
			f, _ := dev.kernel("Fill", "fill", engine.F32, 0)
			enter(t) // as begin does, without its checks
			dev.launch("Fill", f, dev.blocks(b.N, threads), threads, 1, i64(b.N), ptr(b), f32(1))
			dev.exit()
		},
		[]string{"kernel fill_f32: parameter 1 (float * y) = 0x3e8", "not in any live allocation"},
	},
	"kernel-index-out-of-bounds": {
		func(t *testing.T) {
			x, y := mustMalloc(t, 1024, engine.F32), mustMalloc(t, 1024, engine.F32)
			f, _ := dev.kernel("ReLU", "relu", engine.F32, 0)
			enter(t)
			dev.launch("ReLU", f, dev.blocks(1024, threads), threads, 1, ptr(y), ptr(x), i64(1024+64))
			dev.exit()
		},
		[]string{"kernel relu_f32", "illegal read", "0 bytes past the end of the 4096-byte device allocation"},
	},
	"gemm-leading-dimension": {
		func(t *testing.T) {
			a, b, c := mustMalloc(t, 64*32, engine.F32), mustMalloc(t, 32*16, engine.F32), mustMalloc(t, 64*16, engine.F32)
			alpha, beta := float32(1), float32(0)
			enter(t)
			// Row-major C = A·B (64×32 · 32×16) with lda 64 instead of 32: A's last rows run
			// past its buffer.
			s := dev.blas.gemmEx(dev.blas.handle, cublasOpN, cublasOpN, 16, 64, 32, unsafe.Pointer(&alpha),
				uintptr(b.Addr()), cudaR32F, 16, uintptr(a.Addr()), cudaR32F, 64,
				unsafe.Pointer(&beta), uintptr(c.Addr()), cudaR32F, 16, cublasCompute32F, cublasGemmDefault)
			dev.exit()
			if s != 0 {
				t.Fatalf("cublasGemmEx returned %d before running", s)
			}
		},
		[]string{"cublasGemmEx: B (32×64, leading dimension 64", "run 8064 bytes past its end"},
	},
}

// enter is Device.enter for a planted bug, which then calls dev.exit.
func enter(t *testing.T) {
	t.Helper()
	if err := dev.enter(); err != nil {
		dev.exit()
		t.Fatal(err)
	}
}

func mustMalloc(t *testing.T, n int, ty engine.DType) engine.Buf {
	t.Helper()
	b, err := dev.Malloc(n, ty)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

const plantedEnv = "QVD_CUDAEMU_PLANTED"

// TestEmuPlanted runs each planted bug in a child process (TestEmuPlantedChild) and checks
// that the device reported an error and the emulator's diagnostic names the fault.
func TestEmuPlanted(t *testing.T) {
	emulator(t)
	if os.Getenv(plantedEnv) != "" {
		t.Skip("in a child")
	}
	for name, p := range planted {
		t.Run(name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run", "^TestEmuPlantedChild$", "-test.v")
			cmd.Env = append(os.Environ(), plantedEnv+"="+name, "QVD_CUDAEMU_QUIET=1")
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("child: %v\n%s", err, out)
			}
			if !strings.Contains(string(out), plantedOK) {
				t.Fatalf("the child did not see the error:\n%s", out)
			}
			for _, w := range p.want {
				if !strings.Contains(string(out), w) {
					t.Errorf("the diagnostic does not say %q:\n%s", w, out)
				}
			}
		})
	}
}

func TestEmuPlantedChild(t *testing.T) {
	name := os.Getenv(plantedEnv)
	if name == "" {
		t.Skip("run by TestEmuPlanted")
	}
	drv := emulator(t)
	planted[name].bug(t)
	err := dev.Sync()
	if !errors.Is(err, engine.ErrDevice) {
		t.Fatalf("Sync after the planted bug %s: %v, want an error wrapping engine.ErrDevice", name, err)
	}
	// The context is lost, so TestMain's Close would fail: report and leave here.
	fmt.Printf("%s\nSync: %v\nemulator: %s\n", plantedOK, err, drv.LastError())
	os.Exit(0)
}

const plantedOK = "planted bug caught"

// TestEmuConvertSameType runs the convert kernels between equal types, which Copy never
// launches (it copies those with cuMemcpyDtoDAsync): every kernel of the module runs somewhere.
func TestEmuConvertSameType(t *testing.T) {
	emulator(t)
	p := newPair(t)
	for _, ty := range floatTypes {
		v := p.vals(3000, 100)
		copy(v, specials)
		src, dst := p.buf(ty, len(v), v), p.buf(ty, len(v), nil)
		p.h.Copy(dst.h, src.h)
		f, ok := dev.kernel("Copy", "convert", ty, ty)
		if !ok {
			t.Fatalf("no convert kernel for %v", ty)
		}
		enter(t)
		dev.launch("Copy", f, dev.blocks(dst.n, threads), threads, 1, ptr(dst.d), ptr(src.d), i64(dst.n))
		dev.exit()
		p.exact("convert to the same type", dst)
	}
}
