package main

import (
	"fmt"
	"image"
	"image/png"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/qvd/qvd/checkpoint"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
)

// fashionClasses name the exported class folders; the label prefix keeps their sorted order
// the label order, so the folder's labels are the IDX labels.
var fashionClasses = []string{"0-tshirt", "1-trouser", "2-pullover", "3-dress", "4-coat", "5-sandal", "6-shirt", "7-sneaker", "8-bag", "9-boot"}

// exportImageFolder writes the first nTrain training and nTest test samples of the
// installed Fashion-MNIST to root as an image folder of 8-bit grey PNGs,
// SPLIT/CLASS/INDEX.png: the files sort in index order, so the folder's sample order is the
// IDX order.
func exportImageFolder(t testing.TB, root string, nTrain, nTest int) {
	t.Helper()
	cfg := data.DefaultConfig()
	cfg.TrainSubset, cfg.TestSubset, cfg.Cache = nTrain, nTest, data.CacheNone
	train, test, err := data.Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []struct {
		split string
		d     *data.Dataset
	}{{data.SplitTrain, train}, {data.SplitTest, test}} {
		for _, c := range fashionClasses {
			if err := os.MkdirAll(filepath.Join(root, s.split, c), 0o755); err != nil {
				t.Fatal(err)
			}
		}
		d, ss := s.d, s.d.SampleSize()
		for i := range d.N {
			img := &image.Gray{Pix: d.Images[i*ss : (i+1)*ss], Stride: d.W, Rect: image.Rect(0, 0, d.W, d.H)}
			f, err := os.Create(filepath.Join(root, s.split, fashionClasses[d.Labels[i]], fmt.Sprintf("%05d.png", i)))
			if err != nil {
				t.Fatal(err)
			}
			if err := png.Encode(f, img); err != nil {
				t.Fatal(err)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// folderCNNConfig is configs/fashion-cnn.yaml reading the image folder at root, with the
// same normalisation as the IDX config's.
func folderCNNConfig(t *testing.T, root string) string {
	t.Helper()
	b, err := os.ReadFile("../../configs/fashion-cnn.yaml")
	if err != nil {
		t.Fatal(err)
	}
	text := string(b)
	old := "data:\n  dataset: fashion-mnist\n  path: /usr/share/datasets/fashion-mnist\n  normalize: {mean: 0.2860, std: 0.3530}\n"
	if !strings.Contains(text, old) {
		t.Fatalf("configs/fashion-cnn.yaml's data section changed; update this test:\n%s", text)
	}
	text = strings.Replace(text, old, "data:\n  format: image-folder\n  dataset: fashion-folder\n  path: "+root+"\n  mean: [0.2860]\n  std: [0.3530]\n", 1)
	p := filepath.Join(t.TempDir(), "fashion-cnn-folder.yaml")
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestImageFolderMatchesIDX exports a Fashion-MNIST subset to PNGs and trains the shipped
// CNN on it and on the same IDX subset with the same seed and steps: 8-bit grey PNG holds
// the IDX bytes exactly and the folder keeps the IDX sample order, so every step's loss, the
// test accuracy and the final weights must be bit-identical.
func TestImageFolderMatchesIDX(t *testing.T) {
	needDataset(t)
	if testing.Short() {
		t.Skip("trains the CNN twice")
	}
	const nTrain, nTest, steps = 6000, 1000, "90"
	root := t.TempDir()
	exportImageFolder(t, root, nTrain, nTest)

	common := []string{"--max-steps", steps, "--epochs", "1", "--seed", "7", "--quiet"}
	idxOut, folderOut := t.TempDir(), t.TempDir()
	if code, so, se := runQVD(t, append([]string{"train", "-c", "../../configs/fashion-cnn.yaml", "--out", idxOut,
		"--train-subset", fmt.Sprint(nTrain), "--test-subset", fmt.Sprint(nTest)}, common...)...); code != exitOK {
		t.Fatalf("idx run: exit %d\n%s\n%s", code, so, se)
	}
	if code, so, se := runQVD(t, append([]string{"train", "-c", folderCNNConfig(t, root), "--out", folderOut}, common...)...); code != exitOK {
		t.Fatalf("image-folder run: exit %d\n%s\n%s", code, so, se)
	}
	idxRecs, folderRecs := readRecords(t, idxOut), readRecords(t, folderOut)
	if len(idxRecs) == 0 || len(idxRecs) != len(folderRecs) {
		t.Fatalf("%d and %d train/eval records", len(idxRecs), len(folderRecs))
	}
	var acc float64
	for i, a := range idxRecs {
		b := folderRecs[i]
		if a.Kind != b.Kind || a.Step != b.Step || a.Loss != b.Loss || a.Accuracy != b.Accuracy || a.GradNorm != b.GradNorm {
			t.Fatalf("record %d differs:\n idx    %+v\n folder %+v", i, a, b)
		}
		if a.Kind == metrics.KindEval {
			acc = a.Accuracy
		}
	}
	if acc < 0.65 {
		t.Fatalf("test accuracy %.4f: the runs agree but did not learn", acc)
	}
	a, b := lastCheckpoint(t, idxOut), lastCheckpoint(t, folderOut)
	compared := 0
	for _, fi := range a.Files() {
		if !strings.HasSuffix(fi.Name, ".safetensors") {
			continue
		}
		fa, err := a.Safetensors(fi.Name)
		if err != nil {
			t.Fatal(err)
		}
		fb, err := b.Safetensors(fi.Name)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range fa.Names() {
			ta, err1 := fa.Tensor(name)
			tb, err2 := fb.Tensor(name)
			if err1 != nil || err2 != nil {
				continue // not F32 (optimizer bookkeeping): covered by the losses
			}
			if !slices.Equal(ta.Data, tb.Data) {
				t.Fatalf("%s: tensor %s differs between the IDX and image-folder runs", fi.Name, name)
			}
			compared++
		}
	}
	if compared == 0 {
		t.Fatal("no tensors compared")
	}
	t.Logf("bit-identical: %d records, %d tensors, test accuracy %.4f", len(idxRecs), compared, acc)
}

// readRecords returns a run's train and eval records.
func readRecords(t *testing.T, out string) []metrics.Record {
	t.Helper()
	recs, err := metrics.ReadFile(filepath.Join(out, "metrics.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	var keep []metrics.Record
	for _, r := range recs {
		if r.Kind == metrics.KindTrain || r.Kind == metrics.KindEval {
			keep = append(keep, r)
		}
	}
	return keep
}

func lastCheckpoint(t *testing.T, out string) *checkpoint.Checkpoint {
	t.Helper()
	c, _, err := checkpoint.Latest(filepath.Join(out, "checkpoints"))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// TestModelShapeFromData: the model's input and classes come from the data, and a model
// that declares others is refused naming both.
func TestModelShapeFromData(t *testing.T) {
	root := t.TempDir()
	img := image.NewNRGBA(image.Rect(0, 0, 12, 10))
	for i := range img.Pix {
		img.Pix[i] = uint8(i)
	}
	for _, split := range []string{data.SplitTrain, data.SplitTest} {
		for _, class := range []string{"a", "b", "c"} {
			for k := range 4 {
				p := filepath.Join(root, split, class, fmt.Sprintf("%d.png", k))
				os.MkdirAll(filepath.Dir(p), 0o755)
				f, _ := os.Create(p)
				png.Encode(f, img)
				f.Close()
			}
		}
	}
	cfgFile := func(model string) string {
		p := filepath.Join(t.TempDir(), "c.yaml")
		os.WriteFile(p, []byte("model:\n  type: mlp\n  hidden: [8]\n"+model+"data:\n  format: image-folder\n  dataset: tiny\n  path: "+root+"\n"), 0o644)
		return p
	}
	out := t.TempDir()
	code, so, se := runQVD(t, "train", "-c", cfgFile(""), "--out", out, "--max-steps", "2", "--micro-batch", "4")
	if code != exitOK {
		t.Fatalf("exit %d\n%s\n%s", code, so, se)
	}
	if !strings.Contains(so+se, "360-8-3") { // 3×10×12 inputs, 3 classes
		t.Fatalf("model not sized from the data:\n%s\n%s", so, se)
	}
	code, so, se = runQVD(t, "train", "-c", cfgFile("  input: [1, 28, 28]\n  classes: 10\n"), "--out", t.TempDir(), "--max-steps", "1", "--quiet")
	if code == exitOK || !strings.Contains(so+se, "model.input [1 28 28] does not match the data's sample shape [3 10 12]") {
		t.Fatalf("declared input: exit %d\n%s\n%s", code, so, se)
	}
	code, so, se = runQVD(t, "estimate", "-c", cfgFile(""))
	if code != exitOK || !strings.Contains(so, "360-8-3") {
		t.Fatalf("estimate: exit %d\n%s\n%s", code, so, se)
	}
}
