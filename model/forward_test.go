//go:build !cuda

package model

import (
	"math"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

// TestForwardMatchesGorgonia checks the host Forward against the gorgonia evaluation graph,
// an independent implementation of the same Spec: the same loss sum and the same hits.
func TestForwardMatchesGorgonia(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"mlp", Config{Type: TypeMLP, Hidden: []int{16, 8}}},
		{"cnn", Config{Type: TypeCNN, Channels: []int{3, 4}, Kernel: 3, Hidden: []int{8}}},
		{"cnn-k5-nohidden", Config{Type: TypeCNN, Channels: []int{2}, Kernel: 5}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 6
			net, params := tinyNet(t, tc.cfg, n, half.FP32)
			b := randomBatch(n, 64, 4, 11)
			want, err := net.Evaluate(b)
			if err != nil {
				t.Fatal(err)
			}
			logits := make([]float32, n*4)
			if err := Forward(logits, net.Spec(), net.Layout(), params, b.X, n); err != nil {
				t.Fatal(err)
			}
			c := NewConfusion(4)
			if err := c.Add(logits, b.Y, n); err != nil {
				t.Fatal(err)
			}
			if c.Correct() != want.Correct || c.N() != n {
				t.Errorf("correct %d of %d, gorgonia %d of %d", c.Correct(), c.N(), want.Correct, want.N)
			}
			if d := math.Abs(c.LossSum - want.LossSum); d > 1e-4*math.Max(1, want.LossSum) {
				t.Errorf("loss sum %v, gorgonia %v", c.LossSum, want.LossSum)
			}
		})
	}
}

func TestForwardBadSizes(t *testing.T) {
	net, params := tinyNet(t, Config{Type: TypeMLP, Hidden: []int{4}}, 2, half.FP32)
	s, l := net.Spec(), net.Layout()
	cases := []struct {
		name      string
		dst, flat []float32
		x         []float32
		n         int
	}{
		{"short flat", make([]float32, 8), params[:1], make([]float32, 128), 2},
		{"short input", make([]float32, 8), params, make([]float32, 127), 2},
		{"short output", make([]float32, 7), params, make([]float32, 128), 2},
		{"negative n", make([]float32, 8), params, make([]float32, 128), -1},
	}
	for _, c := range cases {
		if err := Forward(c.dst, s, l, c.flat, c.x, c.n); err == nil {
			t.Errorf("%s: no error", c.name)
		}
	}
}

func TestTopK(t *testing.T) {
	got, err := TopK([]float32{1, 3, 2, 3}, 3)
	if err != nil {
		t.Fatal(err)
	}
	if got[0].Class != 1 || got[1].Class != 3 || got[2].Class != 2 {
		t.Fatalf("order %+v, want classes 1, 3 (tie keeps index order), 2", got)
	}
	e := math.Exp
	sum := e(1) + 2*e(3) + e(2)
	if math.Abs(got[0].Prob-e(3)/sum) > 1e-12 || math.Abs(got[2].Prob-e(2)/sum) > 1e-12 {
		t.Fatalf("probabilities %+v", got)
	}
	if all, _ := TopK([]float32{0, 0}, 5); len(all) != 2 {
		t.Fatalf("k beyond the classes: %d results, want 2", len(all))
	}
	if _, err := TopK([]float32{1}, 0); err == nil {
		t.Fatal("k 0: no error")
	}
}

func TestConfusion(t *testing.T) {
	c := NewConfusion(3)
	logits := []float32{5, 0, 0, 0, 5, 0, 0, 5, 0, 0, 0, 5}
	if err := c.Add(logits, []int32{0, 1, 2, 2}, 4); err != nil {
		t.Fatal(err)
	}
	want := []int{1, 0, 0, 0, 1, 0, 0, 1, 1}
	for i, v := range want {
		if c.Counts[i] != v {
			t.Fatalf("counts %v, want %v", c.Counts, want)
		}
	}
	if c.N() != 4 || c.Correct() != 3 || c.Accuracy() != 0.75 {
		t.Fatalf("N %d correct %d accuracy %v", c.N(), c.Correct(), c.Accuracy())
	}
	if err := c.Add(logits, []int32{0, 1, 2, 3}, 4); err == nil {
		t.Fatal("label 3 of 3 classes: no error")
	}
}
