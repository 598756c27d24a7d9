//go:build !cuda

package cuda

import (
	"io"
	"os/exec"
	"testing"

	"github.com/qvd/qvd/memory"
)

// TestOnGPU runs this package's and the NCCL communicator's GPU tests, which are built only
// with -tags cuda and can only start on a machine with an NVIDIA GPU (gorgonia.org/cu exits a
// process that has none). Elsewhere it says so and skips; where there is a GPU but no Go (the
// GPU machines here), scripts/gpu/run.sh runs the prebuilt test binaries instead.
func TestOnGPU(t *testing.T) {
	src := memory.OpenNVML()
	if c, ok := src.(io.Closer); ok {
		defer c.Close()
	}
	if devs, err := src.Devices(); err != nil || len(devs) == 0 {
		t.Skipf("no NVIDIA GPU here (%v): the CUDA backend and NCCL tests need one; on a GPU machine run `go test -tags cuda ./engine/cuda ./collective/nccl`, or scripts/gpu/run.sh with binaries from scripts/gpu/prepare.sh", err)
	}
	if testing.Short() {
		t.Skip("-short: the GPU tests take a while")
	}
	cmd := exec.Command("go", "test", "-tags", "cuda", "-count=1", "./", "../../collective/nccl")
	out, err := cmd.CombinedOutput()
	t.Logf("go test -tags cuda:\n%s", out)
	if err != nil {
		t.Fatalf("the GPU tests failed: %v", err)
	}
}
