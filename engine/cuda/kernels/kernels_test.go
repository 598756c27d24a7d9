package kernels

import (
	"crypto/sha256"
	"encoding/hex"
	"os"
	"os/exec"
	"slices"
	"testing"
)

// TestPTXIsCurrent runs in CI, where there is no nvcc: the committed PTX must have been
// generated from the committed source.
func TestPTXIsCurrent(t *testing.T) {
	src, err := os.ReadFile("kernels.cu")
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(src)
	if got := hex.EncodeToString(sum[:]); got != SourceSHA256 {
		t.Fatalf("kernels.ptx is stale: run go generate ./engine/cuda/kernels (kernels.cu has sha256 %s, kernels.ptx was made from %q)", got, SourceSHA256)
	}
}

// TestEntryPoints checks that the PTX defines exactly the kernels engine/cuda looks up, so a
// renamed or missing instantiation fails here rather than at Open on a GPU machine.
func TestEntryPoints(t *testing.T) {
	want := Names()
	got := Entries()
	for _, n := range want {
		if !slices.Contains(got, n) {
			t.Errorf("kernels.ptx has no entry point %s", n)
		}
	}
	for _, n := range got {
		if !slices.Contains(want, n) {
			t.Errorf("kernels.ptx has entry point %s, which Names does not list", n)
		}
	}
}

// TestPTXAssembles runs ptxas, where it is installed, for the A100's and the H100's
// architectures: what the driver's JIT will do at Open, minus the GPU.
func TestPTXAssembles(t *testing.T) {
	ptxas, err := exec.LookPath("ptxas")
	if err != nil {
		t.Skip("no ptxas on PATH")
	}
	if testing.Short() {
		t.Skip("ptxas takes seconds; skipped with -short")
	}
	for _, arch := range []string{"sm_80", "sm_90"} {
		out, err := exec.Command(ptxas, "-arch="+arch, "kernels.ptx", "-o", os.DevNull).CombinedOutput()
		if err != nil {
			t.Errorf("ptxas -arch=%s kernels.ptx: %v\n%s", arch, err, out)
		}
	}
}
