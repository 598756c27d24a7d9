package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/qvd/qvd/internal/metrics"
)

// A ViT with dropout trains, and a run resumed from a checkpoint draws the masks the
// uninterrupted run drew: every step's loss is the same bit for bit (the masks are seeded from
// the run's seed, the step, the micro-batch and the rank).
func TestViTDropoutResume(t *testing.T) {
	needDataset(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "vit.yaml")
	if err := os.WriteFile(cfg, []byte("model: {type: vit, patch: 7, dim: 16, depth: 2, heads: 2, mlp_ratio: 2, dropout: 0.2}\n"+
		"train: {epochs: 1, micro_batch: 16}\ncheckpoint: {every_steps: 3, keep: 5}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	common := []string{"train", "-c", cfg, "--train-subset", "512", "--test-subset", "64", "--quiet"}
	straight, resumed := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, args := range [][]string{
		append(append([]string{}, common...), "--out", straight, "--max-steps", "6"),
		append(append([]string{}, common...), "--out", resumed, "--max-steps", "3"),
		append(append([]string{}, common...), "--out", resumed, "--max-steps", "6", "--resume", "auto"),
	} {
		if code, stdout, stderr := runQVD(t, args...); code != exitOK {
			t.Fatalf("qvd %v: exit %d\n%s\n%s", args, code, stdout, stderr)
		}
	}
	losses := func(dir string) map[int64]float64 {
		recs, err := metrics.ReadFile(filepath.Join(dir, "metrics.jsonl"))
		if err != nil {
			t.Fatal(err)
		}
		out := map[int64]float64{}
		for _, r := range recs {
			if r.Kind == metrics.KindTrain {
				out[r.Step] = r.Loss
			}
		}
		return out
	}
	// Without dropout the same run takes other steps: the masks are really drawn.
	nodrop := filepath.Join(dir, "nodrop.yaml")
	if err := os.WriteFile(nodrop, []byte("model: {type: vit, patch: 7, dim: 16, depth: 2, heads: 2, mlp_ratio: 2}\ntrain: {epochs: 1, micro_batch: 16}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(dir, "c")
	if code, stdout, stderr := runQVD(t, "train", "-c", nodrop, "--train-subset", "512", "--test-subset", "64", "--quiet", "--out", plain, "--max-steps", "2"); code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	a, b := losses(straight), losses(resumed)
	if c := losses(plain); c[1] == a[1] {
		t.Errorf("step 1's loss %v is the same with and without dropout", a[1])
	}
	for step := int64(1); step <= 6; step++ {
		if _, ok := a[step]; !ok || a[step] != b[step] {
			t.Errorf("step %d: loss %v uninterrupted, %v resumed", step, a[step], b[step])
		}
	}
}
