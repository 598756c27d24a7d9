//go:build !cuda

package model

import (
	"strings"
	"testing"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
)

func TestFreezeConfig(t *testing.T) {
	spec, err := NewSpec(Config{Type: TypeMLP, Hidden: []int{8, 8}}, []int{1, 4, 4}, 3)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		cfg  FreezeConfig
		want []string // frozen tensors
		err  string
	}{
		{FreezeConfig{Ratio: 0.85}, []string{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}, ""}, // floor(0.85 × 3) = 2 layers
		{FreezeConfig{Ratio: 0.3}, nil, "nothing frozen"},                                             // floor(0.9) = 0
		{FreezeConfig{Names: []string{"fc2.*"}}, []string{"fc2.weight", "fc2.bias"}, ""},
		{FreezeConfig{Names: []string{"fc9.*"}}, nil, "matches no parameter"},
		{FreezeConfig{Names: []string{"*"}}, nil, "nothing left to train"},
	} {
		f, err := c.cfg.Frozen(spec)
		switch {
		case c.err == "nothing frozen":
			if err != nil {
				t.Fatalf("%+v: %v", c.cfg, err)
			}
			for _, n := range []string{"fc1.weight", "fc3.bias"} {
				if f != nil && f(n) {
					t.Fatalf("%+v froze %s", c.cfg, n)
				}
			}
			continue
		case c.err != "":
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Fatalf("%+v: %v, want an error saying %q", c.cfg, err, c.err)
			}
			continue
		case err != nil:
			t.Fatalf("%+v: %v", c.cfg, err)
		}
		var got []string
		for _, n := range []string{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"} {
			if f(n) {
				got = append(got, n)
			}
		}
		if strings.Join(got, ",") != strings.Join(c.want, ",") {
			t.Fatalf("%+v froze %v, want %v", c.cfg, got, c.want)
		}
	}
	if err := (FreezeConfig{Ratio: 1}).Validate(); err == nil || !strings.Contains(err.Error(), "ratio") {
		t.Fatalf("ratio 1: %v", err)
	}
	if err := (FreezeConfig{Names: []string{"[a"}}).Validate(); err == nil || !strings.Contains(err.Error(), "names[0]") {
		t.Fatalf("bad pattern: %v", err)
	}
}

// TestFrozenNet: frozen tensors are constants of the graph: the gradient buffer covers only the
// trainable suffix, and its values equal the unfrozen net's gradients of those tensors.
func TestFrozenNet(t *testing.T) {
	spec, _ := NewSpec(Config{Type: TypeMLP, Hidden: []int{8, 8}}, []int{1, 4, 4}, 3)
	plainL := NewLayout(spec)
	plainP := make([]float32, plainL.Size)
	Init(spec, plainL, plainP, 3)
	spec2, _ := NewSpec(Config{Type: TypeMLP, Hidden: []int{8, 8}}, []int{1, 4, 4}, 3)
	frozenL := NewLayoutFrozen(spec2, func(n string) bool { return strings.HasPrefix(n, "fc1.") })
	frozenP := make([]float32, frozenL.Size)
	Init(spec2, frozenL, frozenP, 3)
	b := data.NewBatch(4, 16)
	b.N = 4
	for i := range b.X {
		b.X[i] = float32(i%7) / 7
	}
	for i := range b.Y[:4] {
		b.Y[i] = int32(i % 3)
	}
	nets := []*Net{}
	for _, c := range []struct {
		s *Spec
		l *Layout
		p []float32
	}{{spec, plainL, plainP}, {spec2, frozenL, frozenP}} {
		n, err := New(c.s, c.l, c.p, Options{MicroBatch: 4, EvalBatch: 4, Grad: half.FP32})
		if err != nil {
			t.Fatal(err)
		}
		defer n.Close()
		nets = append(nets, n)
	}
	gPlain := make([]float32, plainL.Size)
	gFrozen := make([]float32, frozenL.Trainable())
	l1, err1 := nets[0].ForwardBackward(b, 1, FlatSink(gPlain))
	l2, err2 := nets[1].ForwardBackward(b, 1, FlatSink(gFrozen))
	if err1 != nil || err2 != nil || l1 != l2 {
		t.Fatalf("losses %v %v (%v, %v)", l1, l2, err1, err2)
	}
	for _, ts := range frozenL.Tensors {
		if ts.Frozen {
			continue
		}
		p, _ := plainL.Lookup(ts.Name)
		for i := 0; i < ts.Size; i++ {
			if gPlain[p.Offset+i] != gFrozen[ts.Offset-frozenL.Frozen+i] {
				t.Fatalf("%s[%d]: gradient %v with fc1 frozen, %v without", ts.Name, i, gFrozen[ts.Offset-frozenL.Frozen+i], gPlain[p.Offset+i])
			}
		}
	}
}
