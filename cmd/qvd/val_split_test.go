package main

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/qvd/qvd/internal/metrics"
)

// TestTrainValSplit: data.val_split makes qvd train evaluate the held-out samples after
// every epoch (records of kind val) and the test split once, at the end; its checkpoint's
// config carries the split, so qvd eval of it still evaluates the test split.
func TestTrainValSplit(t *testing.T) {
	needDataset(t)
	cfgPath := filepath.Join(t.TempDir(), "val.yaml")
	yaml := "model: {type: mlp, hidden: [32]}\ndata: {val_split: 0.1}\ntrain: {epochs: 2, micro_batch: 60}\n"
	if err := os.WriteFile(cfgPath, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	code, stdout, stderr := runQVD(t, "train", "-c", cfgPath, "--out", out, "--train-subset", "1200", "--test-subset", "300", "--quiet")
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, stdout, stderr)
	}
	recs, err := metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var val, test []metrics.Record
	steps := int64(0)
	for _, r := range recs {
		switch r.Kind {
		case metrics.KindVal:
			val = append(val, r)
		case metrics.KindEval:
			test = append(test, r)
		case metrics.KindTrain:
			steps = max(steps, r.Step)
		}
	}
	// 1200 - 120 held out = 1080 samples: 18 steps of 60 per epoch.
	if steps != 36 || len(val) != 2 || len(test) != 1 {
		t.Fatalf("%d steps, %d val and %d test records; want 36, 2 and 1", steps, len(val), len(test))
	}
	if val[0].Step != 18 || val[0].Samples != 120 || test[0].Step != 36 || test[0].Samples != 300 {
		t.Errorf("val %+v, test %+v", val[0], test[0])
	}
}
