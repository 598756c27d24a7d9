package job

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"go.uber.org/goleak"
	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/trainer"
)

// writeIDX writes an IDX file: the magic, the dimensions, the bytes (MNIST's format).
func writeIDX(t *testing.T, path string, magic uint32, dims []uint32, payload []byte) {
	t.Helper()
	var b bytes.Buffer
	_ = binary.Write(&b, binary.BigEndian, magic)
	for _, d := range dims {
		_ = binary.Write(&b, binary.BigEndian, d)
	}
	b.Write(payload)
	if err := os.WriteFile(path, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
}

// synthData writes a small Fashion-MNIST-shaped data set (8×8 grey images, 10 classes) whose
// pixels depend on the label, so that a few steps of training move the weights.
func synthData(t *testing.T, train, test int) string {
	dir := t.TempDir()
	split := func(images, labels string, n int, seed uint32) {
		pix, lab := make([]byte, n*64), make([]byte, n)
		x := seed
		for i := range n {
			lab[i] = byte(i % 10)
			for p := range 64 {
				x = x*1664525 + 1013904223 // an LCG: the same bytes every run
				pix[i*64+p] = byte(x>>24) / 2
				if p%10 == int(lab[i]) {
					pix[i*64+p] += 120
				}
			}
		}
		writeIDX(t, filepath.Join(dir, images), data.MagicIDXImages, []uint32{uint32(n), 8, 8}, pix)
		writeIDX(t, filepath.Join(dir, labels), data.MagicIDXLabels, []uint32{uint32(n)}, lab)
	}
	split(data.TrainImagesFile, data.TrainLabelsFile, train, 1)
	split(data.TestImagesFile, data.TestLabelsFile, test, 2)
	return dir
}

// testConfig is a tiny MLP job on dir's data writing to out, micro-batch micro per rank.
func testConfig(t *testing.T, dir, out string, micro int) configs.Config {
	t.Helper()
	text := fmt.Sprintf(`run: {name: inproc, seed: 7, out: %q}
model: {type: mlp, hidden: [16]}
data: {path: %q, cache: none}
train: {micro_batch: %d, accum: 1, epochs: 1, max_steps: 5, eval_batch: 16, threads: 1}
optimizer: {type: adamw, lr: 0.01}
`, out, dir, micro)
	return parseConfig(t, text)
}

// parseConfig parses, resolves and validates a test job's YAML.
func parseConfig(t *testing.T, text string) configs.Config {
	t.Helper()
	cfg, err := configs.Parse([]byte(text), "test")
	if err != nil {
		t.Fatal(err)
	}
	cfg.Resolve()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// readWeights reads every tensor of a checkpoint's model.safetensors.
func readWeights(t *testing.T, ckpt string) map[string][]float32 {
	t.Helper()
	f, err := checkpoint.ReadSafetensorsFile(filepath.Join(ckpt, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string][]float32{}
	for _, n := range f.Names() {
		ten, err := f.Tensor(n)
		if err != nil {
			t.Fatal(err)
		}
		out[n] = ten.Data
	}
	return out
}

// TestRunInProcessGroup runs whole jobs through Run, every rank a goroutine of this test over
// the in-process transport: each rank ends with bit-identical weights (the same
// WeightsSHA256), and those are the weights of one process trained with the same global
// batch (micro-batch N·m), within float tolerance — only the summation order of the gradient
// differs, as trainer's TestDataParallelEquivalence states.
func TestRunInProcessGroup(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	dir := synthData(t, 120, 40)
	const micro = 4
	var single bytes.Buffer
	want, err := Run(context.Background(), testConfig(t, dir, t.TempDir(), 3*micro),
		Options{Stdout: &single, Quiet: true, LogLevel: zapcore.WarnLevel})
	if err != nil {
		t.Fatalf("one process: %v", err)
	}
	if want.Steps != 5 || !strings.Contains(single.String(), "done: 5 steps") {
		t.Fatalf("one process: %d steps, stdout:\n%s", want.Steps, single.String())
	}
	wantW := readWeights(t, want.Checkpoint)
	for _, n := range []int{2, 3} {
		t.Run(fmt.Sprintf("N%d", n), func(t *testing.T) {
			cfg := testConfig(t, dir, t.TempDir(), 3*micro/n)
			_, transports := collective.NewInproc(n, 1)
			res, errs := make([]trainer.Result, n), make([]error, n)
			var stdout, stderr [3]bytes.Buffer
			var wg sync.WaitGroup
			for r := range n {
				comm, err := collective.NewRing(transports[r], collective.DefaultConfig())
				if err != nil {
					t.Fatal(err)
				}
				defer comm.Close()
				defer transports[r].Close()
				wg.Add(1)
				go func() {
					defer wg.Done()
					res[r], errs[r] = Run(context.Background(), cfg, Options{Stdout: &stdout[r], Stderr: &stderr[r], Quiet: true, Comm: comm})
				}()
			}
			wg.Wait()
			for r := range n {
				if errs[r] != nil {
					t.Fatalf("rank %d: %v\n%s", r, errs[r], stderr[r].String())
				}
				if res[r].Steps != want.Steps || res[r].WeightsSHA256 == "" || res[r].WeightsSHA256 != res[0].WeightsSHA256 {
					t.Fatalf("rank %d: %d steps, weights %s; rank 0: %d steps, weights %s", r, res[r].Steps, res[r].WeightsSHA256, res[0].Steps, res[0].WeightsSHA256)
				}
			}
			if !strings.Contains(stdout[0].String(), "done: 5 steps") || stdout[1].Len() != 0 {
				t.Errorf("rank 0 prints the summary, the others nothing:\n%q\n%q", stdout[0].String(), stdout[1].String())
			}
			if !strings.Contains(stderr[1].String(), `"rank": 1`) || !strings.Contains(stderr[1].String(), "weights_sha256") {
				t.Errorf("rank 1's log does not name its rank and weights:\n%s", stderr[1].String())
			}
			got, worst := readWeights(t, res[0].Checkpoint), 0.0
			for name, w := range wantW {
				g := got[name]
				if len(g) != len(w) {
					t.Fatalf("%s: %d values, one process has %d", name, len(g), len(w))
				}
				for i := range w {
					worst = math.Max(worst, math.Abs(float64(w[i]-g[i])))
				}
			}
			t.Logf("%d ranks: weights %s…, max difference from one process %.3g", n, res[0].WeightsSHA256[:12], worst)
			if worst > 1e-5 {
				t.Fatalf("%d ranks end %g away from one process with the same global batch", n, worst)
			}
		})
	}
}
