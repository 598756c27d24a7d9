package model

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/qvd/qvd/checkpoint"
)

// initSpec is a small CNN: conv1, fc1, fc2 (two of them transposed in the flat buffer).
func initSpec(t *testing.T, classes int) (*Spec, *Layout) {
	t.Helper()
	s, err := NewSpec(Config{Type: TypeCNN, Channels: []int{2}, Kernel: 3, Hidden: []int{5}}, []int{1, 4, 4}, classes)
	if err != nil {
		t.Fatal(err)
	}
	return s, NewLayout(s)
}

// canonicalTensors are the layout's tensors in canonical shape, element i of tensor k being
// 1000k+i, under prefix+name, as a model.safetensors or a torch state_dict holds them.
func canonicalTensors(l *Layout, prefix string) []checkpoint.Tensor {
	var ts []checkpoint.Tensor
	for k, t := range l.Tensors {
		d := make([]float32, t.Size)
		for i := range d {
			d[i] = float32(1000*k + i)
		}
		ts = append(ts, checkpoint.Tensor{Name: prefix + t.Name, Shape: t.Shape, Data: d})
	}
	return ts
}

func writeST(t *testing.T, ts []checkpoint.Tensor) string {
	t.Helper()
	var b bytes.Buffer
	if err := checkpoint.WriteSafetensors(&b, ts, nil); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "w.safetensors")
	if err := os.WriteFile(p, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestInitFrom(t *testing.T) {
	_, l := initSpec(t, 3)
	full := canonicalTensors(l, "")
	without := func(ts []checkpoint.Tensor, names ...string) []checkpoint.Tensor {
		return slices.DeleteFunc(slices.Clone(ts), func(x checkpoint.Tensor) bool { return slices.Contains(names, x.Name) })
	}
	_, other := initSpec(t, 7) // a 7-class head
	cases := []struct {
		name       string
		tensors    []checkpoint.Tensor
		renames    []Rename
		strict     bool
		loaded     int
		missing    []string
		unexpected []string
		err        error  // errors.Is target; nil: success
		errHas     string // a piece of the message
	}{
		{name: "exact", tensors: full, strict: true, loaded: 6},
		{name: "prefix renamed", tensors: canonicalTensors(l, "model."), renames: []Rename{{From: `^model\.`, To: ""}}, strict: true, loaded: 6},
		{name: "renames in order", tensors: canonicalTensors(l, "a."), renames: []Rename{{From: `^a\.`, To: "b."}, {From: `^b\.(.*)$`, To: "$1"}}, strict: true, loaded: 6},
		{name: "strict missing head", tensors: without(full, "fc2.weight", "fc2.bias"), strict: true,
			missing: []string{"fc2.weight", "fc2.bias"}, err: ErrInitMismatch, errHas: "missing from the file: fc2.weight, fc2.bias"},
		{name: "partial load", tensors: without(full, "fc2.weight", "fc2.bias"), strict: false, loaded: 4, missing: []string{"fc2.weight", "fc2.bias"}},
		{name: "strict unexpected", tensors: append(slices.Clone(full), checkpoint.Tensor{Name: "head.weight", Shape: []int{1}, Data: []float32{1}}), strict: true,
			loaded: 6, unexpected: []string{"head.weight"}, err: ErrInitMismatch, errHas: "not in the model: head.weight"},
		{name: "lenient unexpected", tensors: append(slices.Clone(full), checkpoint.Tensor{Name: "head.weight", Shape: []int{1}, Data: []float32{1}}), strict: false,
			loaded: 6, unexpected: []string{"head.weight"}},
		{name: "shape mismatch", tensors: canonicalTensors(other, ""), strict: false,
			err: ErrInitShape, errHas: `tensor fc2.weight: shape mismatch: the file's "fc2.weight" is [7 5], the model's is [3 5]`},
		{name: "two map to one", tensors: append(slices.Clone(full), checkpoint.Tensor{Name: "x.fc2.bias", Shape: []int{3}, Data: []float32{1, 2, 3}}),
			renames: []Rename{{From: `^x\.`, To: ""}}, strict: true, errHas: `both map to "fc2.bias"`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := writeST(t, c.tensors)
			flat := make([]float32, l.Size)
			for i := range flat {
				flat[i] = -1
			}
			rep, err := LoadInit(InitConfig{From: path, Map: c.renames, Strict: c.strict}, l, flat)
			if c.err != nil && !errors.Is(err, c.err) || c.errHas != "" && (err == nil || !strings.Contains(err.Error(), c.errHas)) || c.err == nil && c.errHas == "" && err != nil {
				t.Fatalf("error %v, want %v containing %q", err, c.err, c.errHas)
			}
			if err != nil {
				if !strings.Contains(err.Error(), path) {
					t.Errorf("error %q does not name the file", err)
				}
				for _, v := range flat {
					if v != -1 {
						t.Fatal("a failed load wrote into the flat buffer")
					}
				}
				return
			}
			if len(rep.Loaded) != c.loaded || !slices.Equal(rep.Missing, c.missing) || !slices.Equal(rep.Unexpected, c.unexpected) {
				t.Fatalf("report %+v, want %d loaded, missing %v, unexpected %v", rep, c.loaded, c.missing, c.unexpected)
			}
			// Every loaded tensor reads back in canonical order; the missing keep their values.
			for k, tt := range l.Tensors {
				got := make([]float32, tt.Size)
				l.Canonical(got, flat, tt)
				if slices.Contains(c.missing, tt.Name) {
					if got[0] != -1 {
						t.Errorf("missing %s was overwritten", tt.Name)
					}
					continue
				}
				for i, v := range got {
					if v != float32(1000*k+i) {
						t.Fatalf("%s[%d] = %v, want %v", tt.Name, i, v, 1000*k+i)
					}
				}
			}
		})
	}
}

func TestInitFromMissingFile(t *testing.T) {
	_, l := initSpec(t, 3)
	_, err := LoadInit(InitConfig{From: filepath.Join(t.TempDir(), "nope.safetensors"), Strict: true}, l, make([]float32, l.Size))
	if !errors.Is(err, os.ErrNotExist) || !strings.Contains(err.Error(), "nope.safetensors") {
		t.Fatalf("error %v, want one naming the missing file", err)
	}
}

func TestInitConfigValidate(t *testing.T) {
	cases := []struct {
		cfg  InitConfig
		want string // "" for valid
	}{
		{DefaultInitConfig(), ""},
		{InitConfig{From: "w.safetensors", Map: []Rename{{From: `^backbone\.`, To: ""}}}, ""},
		{InitConfig{Map: []Rename{{From: "a", To: "b"}}}, "init_map: set without init_from"},
		{InitConfig{From: "w", Map: []Rename{{From: "a"}, {From: "("}}}, "init_map[1].from"},
		{InitConfig{From: "w", Map: []Rename{{To: "x"}}}, "init_map[0].from: must be a regular expression"},
	}
	for _, c := range cases {
		err := c.cfg.Validate()
		if c.want == "" && err != nil || c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)) {
			t.Errorf("%+v: error %v, want %q", c.cfg, err, c.want)
		}
	}
}
