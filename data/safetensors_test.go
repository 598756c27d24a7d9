package data

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// stTensor is a tensor to write: dtype, shape and its raw little-endian bytes.
type stTensor struct {
	dtype string
	shape []int
	raw   []byte
}

// writeST writes a safetensors file; edit, when set, may change the header before encoding.
func writeST(t testing.TB, path string, tensors map[string]stTensor, edit func(h map[string]any)) {
	t.Helper()
	header := map[string]any{}
	var data []byte
	for _, name := range []string{TensorImages, TensorLabels, "extra"} {
		ts, ok := tensors[name]
		if !ok {
			continue
		}
		header[name] = map[string]any{"dtype": ts.dtype, "shape": ts.shape, "data_offsets": []int{len(data), len(data) + len(ts.raw)}}
		data = append(data, ts.raw...)
	}
	if edit != nil {
		edit(header)
	}
	h, err := json.Marshal(header)
	if err != nil {
		t.Fatal(err)
	}
	for len(h)%8 != 0 {
		h = append(h, ' ')
	}
	out := binary.LittleEndian.AppendUint64(nil, uint64(len(h)))
	out = append(append(out, h...), data...)
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

func i64s(v ...int64) []byte {
	var b []byte
	for _, x := range v {
		b = binary.LittleEndian.AppendUint64(b, uint64(x))
	}
	return b
}

func f32s(v ...float32) []byte {
	var b []byte
	for _, x := range v {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
	}
	return b
}

func stConfig(dir string) Config {
	cfg := DefaultConfig()
	cfg.Format, cfg.Path, cfg.Dataset = FormatSafetensors, dir, "synthetic"
	return cfg
}

func TestSafetensorsU8(t *testing.T) {
	dir := t.TempDir()
	// 5 grey 2x3 images [N, H, W] with I64 labels 0..2; test 2 images.
	writeST(t, filepath.Join(dir, SafetensorsTrainFile), map[string]stTensor{
		TensorImages: {"U8", []int{5, 2, 3}, seq(30)},
		TensorLabels: {"I64", []int{5}, i64s(0, 1, 2, 1, 0)},
		"extra":      {"F32", []int{1}, f32s(1)},
	}, nil)
	writeST(t, filepath.Join(dir, SafetensorsTestFile), map[string]stTensor{
		TensorImages: {"U8", []int{2, 1, 2, 3}, seq(12)},
		TensorLabels: {"U8", []int{2}, []byte{2, 0}},
	}, nil)
	cfg := stConfig(dir)
	cfg.TrainSubset = 4
	train, test, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if train.Shape() != (Shape{C: 1, H: 2, W: 3, Classes: 3}) || train.N != 4 || test.N != 2 || train.Mapped == "" {
		t.Fatalf("train %+v", *train)
	}
	if s, err := Describe(cfg); err != nil || s != train.Shape() {
		t.Fatalf("Describe = %+v, %v", s, err)
	}
	b := NewBatch(2, 6)
	if err := train.Fill(b, []int32{3, 1}, Normalize{Mean: 0, Std: 1}); err != nil {
		t.Fatal(err)
	}
	if b.X[0] != wantValue(seq(30)[18], Normalize{Mean: 0, Std: 1}) || b.Y[0] != 1 || b.Y[1] != 1 {
		t.Fatalf("batch %v %v", b.X, b.Y)
	}
}

func TestSafetensorsF32(t *testing.T) {
	dir := t.TempDir()
	vals := make([]float32, 3*2*2*2)
	for i := range vals {
		vals[i] = float32(i) / 24
	}
	writeST(t, filepath.Join(dir, SafetensorsTrainFile), map[string]stTensor{
		TensorImages: {"F32", []int{3, 2, 2, 2}, f32s(vals...)},
		TensorLabels: {"I32", []int{3}, []byte{0, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0}},
	}, nil)
	writeST(t, filepath.Join(dir, SafetensorsTestFile), map[string]stTensor{
		TensorImages: {"F32", []int{1, 2, 2, 2}, f32s(vals[:8]...)},
		TensorLabels: {"I32", []int{1}, []byte{1, 0, 0, 0}},
	}, nil)
	cfg := stConfig(dir)
	cfg.Mean, cfg.Std = []float32{0.5, 0}, []float32{0.5, 2}
	train, _, err := Load(cfg)
	if err != nil {
		t.Fatal(err)
	}
	norm, _ := cfg.Norm(2)
	b := NewBatch(1, 8)
	if err := train.Fill(b, []int32{2}, norm); err != nil {
		t.Fatal(err)
	}
	for k := range 8 {
		v := float64(vals[16+k])
		want := float32((v - 0.5) / 0.5)
		if k >= 4 {
			want = float32(v / 2)
		}
		if b.X[k] != want {
			t.Fatalf("value %d = %g, want %g", k, b.X[k], want)
		}
	}
}

// TestSafetensorsErrors: each problem is an error naming the file, tensor, dtype or shape.
func TestSafetensorsErrors(t *testing.T) {
	good := func() map[string]stTensor {
		return map[string]stTensor{
			TensorImages: {"U8", []int{2, 2, 2}, seq(8)},
			TensorLabels: {"U8", []int{2}, []byte{0, 1}},
		}
	}
	for _, c := range []struct {
		name string
		edit func(m map[string]stTensor)
		hdr  func(h map[string]any)
		raw  []byte // the whole train file, if set
		want []string
	}{
		{"no images", func(m map[string]stTensor) { delete(m, TensorImages) }, nil, nil, []string{`no tensor "images"`, "labels"}},
		{"image dtype", func(m map[string]stTensor) { m[TensorImages] = stTensor{"F16", []int{2, 2, 2}, seq(16)} }, nil, nil, []string{`tensor "images": dtype F16, want U8`}},
		{"image shape", func(m map[string]stTensor) { m[TensorImages] = stTensor{"U8", []int{8}, seq(8)} }, nil, nil, []string{`tensor "images": shape [8], want [N, C, H, W]`}},
		{"label dtype", func(m map[string]stTensor) { m[TensorLabels] = stTensor{"F32", []int{2}, f32s(0, 1)} }, nil, nil, []string{`tensor "labels": dtype F32, want an integer dtype`}},
		{"label count", func(m map[string]stTensor) { m[TensorLabels] = stTensor{"U8", []int{3}, []byte{0, 1, 1}} }, nil, nil, []string{`tensor "labels": shape [3], want [2]`}},
		{"label range", func(m map[string]stTensor) { m[TensorLabels] = stTensor{"I64", []int{2}, i64s(0, -1)} }, nil, nil, []string{`tensor "labels": label -1 at index 1`}},
		{"offsets", nil, func(h map[string]any) {
			h[TensorImages].(map[string]any)["data_offsets"] = []int{0, 100}
		}, nil, []string{`tensor "images": data_offsets [0 100] outside`}},
		{"size", nil, func(h map[string]any) {
			h[TensorImages].(map[string]any)["shape"] = []int{2, 2, 3}
		}, nil, []string{`tensor "images": U8[2 2 3] needs 12 bytes`}},
		{"truncated", nil, nil, []byte{1, 2, 3}, []string{"shorter than the 8-byte header length"}},
		{"huge header", nil, nil, binary.LittleEndian.AppendUint64(nil, 1<<40), []string{"header length 1099511627776 exceeds"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			m := good()
			if c.edit != nil {
				c.edit(m)
			}
			train := filepath.Join(dir, SafetensorsTrainFile)
			writeST(t, train, m, c.hdr)
			if c.raw != nil {
				os.WriteFile(train, c.raw, 0o644)
			}
			writeST(t, filepath.Join(dir, SafetensorsTestFile), good(), nil)
			_, _, err := Load(stConfig(dir))
			for _, w := range append(c.want, train) {
				if err == nil || !strings.Contains(err.Error(), w) {
					t.Fatalf("Load: %v, want it to contain %q", err, w)
				}
			}
		})
	}
	// A test label that is no training class.
	dir := t.TempDir()
	writeST(t, filepath.Join(dir, SafetensorsTrainFile), good(), nil)
	m := good()
	m[TensorLabels] = stTensor{"U8", []int{2}, []byte{0, 5}}
	writeST(t, filepath.Join(dir, SafetensorsTestFile), m, nil)
	if _, _, err := Load(stConfig(dir)); err == nil || !strings.Contains(err.Error(), "label 5 at index 1 is not a class of the training set (0 to 1)") {
		t.Fatalf("test label beyond the classes: %v", err)
	}
}
