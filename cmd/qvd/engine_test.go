package main

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/job"
)

// TestEnginesMatch trains the shipped MLP config for a few steps with the native engine on
// the CPU backend (the default), on the engine's plain-Go reference device (which runs the
// GPU's code path: there is no GPU in CI) and with the gorgonia engine (the oracle): the
// weights must agree within float tolerance, in fp32 and, more loosely, in bf16 where the
// native engine keeps activations in half precision. On a GPU machine the same run with
// --device cuda is in docs/gpu.md.
func TestEnginesMatch(t *testing.T) {
	needDataset(t)
	for _, tc := range []struct {
		name, precision string
		extra           []string
		tol             float64
	}{{"fp32", "fp32", nil, 1e-5}, {"bf16", "bf16", nil, 2e-3}, {"fp32-checkpointing", "fp32", []string{"--activation-checkpointing", "2"}, 1e-5}} {
		t.Run(tc.name, func(t *testing.T) {
			dirs := map[string]string{}
			for _, e := range []struct{ name, flag, value, logs string }{
				{"native-cpu", "--device", "cpu", `"device": "cpu (`},
				{"native-reference", "--device", "reference", "host reference device"},
				{"gorgonia", "--engine", "gorgonia", ""},
			} {
				out := filepath.Join(t.TempDir(), e.name)
				args := append([]string{"train", "-c", "../../configs/fashion-mlp.yaml", e.flag, e.value, "--out", out,
					"--max-steps", "20", "--train-subset", "4000", "--test-subset", "500", "--precision", tc.precision, "--quiet"}, tc.extra...)
				code, stdout, stderr := runQVD(t, args...)
				if code != exitOK {
					t.Fatalf("%s: exit %d\n%s\n%s", e.name, code, stdout, stderr)
				}
				if !strings.Contains(stderr, e.logs) {
					t.Errorf("%s: the log does not say %q:\n%s", e.name, e.logs, stderr)
				}
				dirs[e.name] = filepath.Join(out, "checkpoints")
			}
			for _, other := range []string{"native-reference", "gorgonia"} {
				d := maxDiff(t, readModel(t, dirs["native-cpu"]), readModel(t, dirs[other]))
				t.Logf("%s: max |w_native-cpu - w_%s| after 20 steps = %.3g", tc.precision, other, d)
				if d > tc.tol {
					t.Fatalf("weights differ from %s by %.3g > %.3g", other, d, tc.tol)
				}
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
	if !job.NCCLAvailable {
		code, stdout, stderr := runQVD(t, "train", "--device", "cuda", "--out", dir, "--max-steps", "1", "--quiet")
		if code == exitOK || !strings.Contains(stdout+stderr, "-tags cuda") {
			t.Errorf("--device cuda without CUDA support: exit %d\n%s%s", code, stdout, stderr)
		}
	}
}
