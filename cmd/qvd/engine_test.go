package main

import (
	"path/filepath"
	"strings"
	"testing"
)

// TestGPUEngineMatchesCPU trains the shipped MLP config for a few steps on the GPU engine
// (over its plain-Go reference device: there is no GPU in CI) and on the CPU engine: the
// weights must agree within float tolerance, in fp32 and, more loosely, in bf16 where the GPU
// engine also keeps activations in half precision. On a GPU machine the same run with
// --device cuda is in docs/gpu.md.
func TestGPUEngineMatchesCPU(t *testing.T) {
	needDataset(t)
	for _, tc := range []struct {
		name, precision string
		extra           []string
		tol             float64
	}{{"fp32", "fp32", nil, 1e-5}, {"bf16", "bf16", nil, 2e-3}, {"fp32-checkpointing", "fp32", []string{"--activation-checkpointing", "2"}, 1e-5}} {
		t.Run(tc.name, func(t *testing.T) {
			dirs := map[string]string{}
			for _, dev := range []string{"cpu", "reference"} {
				out := filepath.Join(t.TempDir(), dev)
				args := append([]string{"train", "-c", "../../configs/fashion-mlp.yaml", "--device", dev, "--out", out,
					"--max-steps", "20", "--train-subset", "4000", "--test-subset", "500", "--precision", tc.precision, "--quiet"}, tc.extra...)
				code, stdout, stderr := runQVD(t, args...)
				if code != exitOK {
					t.Fatalf("--device %s: exit %d\n%s\n%s", dev, code, stdout, stderr)
				}
				if dev == "reference" && !strings.Contains(stderr, "GPU engine") {
					t.Errorf("--device reference did not log the GPU engine:\n%s", stderr)
				}
				dirs[dev] = filepath.Join(out, "checkpoints")
			}
			d := maxDiff(t, readModel(t, dirs["cpu"]), readModel(t, dirs["reference"]))
			t.Logf("%s: max |w_cpu - w_gpu| after 20 steps = %.3g", tc.precision, d)
			if d > tc.tol {
				t.Fatalf("weights differ by %.3g > %.3g", d, tc.tol)
			}
		})
	}
}

func TestDeviceFlagErrors(t *testing.T) {
	dir := t.TempDir()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"train", "--device", "tpu", "--out", dir}, "device.type: must be cpu, cuda or reference"},
		{[]string{"train", "--transport", "nccl", "--out", dir}, "transport: nccl needs device.type: cuda"},
	} {
		code, stdout, stderr := runQVD(t, c.args...)
		if code != exitUsage || !strings.Contains(stdout+stderr, c.want) {
			t.Errorf("qvd %v: exit %d, want %d with %q\n%s%s", c.args, code, exitUsage, c.want, stdout, stderr)
		}
	}
	if newNCCL == nil {
		code, stdout, stderr := runQVD(t, "train", "--device", "cuda", "--out", dir, "--max-steps", "1", "--quiet")
		if code == exitOK || !strings.Contains(stdout+stderr, "-tags cuda") {
			t.Errorf("--device cuda without CUDA support: exit %d\n%s%s", code, stdout, stderr)
		}
	}
}
