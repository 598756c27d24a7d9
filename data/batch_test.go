package data

import (
	"math"
	"strings"
	"testing"
)

// synthDataset is 12 samples of 2x3 with pixel values covering 0 and 255.
func synthDataset() *Dataset {
	d := &Dataset{Name: FashionMNIST, N: 12, C: 1, H: 2, W: 3, Classes: NumClasses}
	d.Images = seq(12 * 6)
	d.Images[0], d.Images[1] = 0, 255
	d.Labels = make([]uint8, 12)
	for i := range d.Labels {
		d.Labels[i] = uint8((i * 3) % 10)
	}
	return d
}

func wantValue(p uint8, n Normalize) float32 {
	return float32((float64(p)/255 - float64(n.Mean)) / float64(n.Std))
}

func TestFillNormalises(t *testing.T) {
	d := synthDataset()
	norm := Normalize{Mean: 0.5, Std: 0.25}
	b := NewBatch(4, d.SampleSize())
	idx := []int32{0, 11, 5}
	if err := d.Fill(b, idx, norm); err != nil {
		t.Fatal(err)
	}
	if b.N != 3 {
		t.Fatalf("N = %d", b.N)
	}
	for r, i := range idx {
		for k := range 6 {
			p := d.Images[int(i)*6+k]
			if got := b.X[r*6+k]; got != wantValue(p, norm) {
				t.Fatalf("row %d value %d: %g, want %g", r, k, got, wantValue(p, norm))
			}
		}
		if b.Y[r] != int32(d.Labels[i]) {
			t.Fatalf("row %d label %d, want %d", r, b.Y[r], d.Labels[i])
		}
	}
	// The ends of the scale, by hand: 0 -> -mean/std, 255 -> (1-mean)/std.
	if b.X[0] != -2 || b.X[1] != 2 {
		t.Fatalf("pixels 0 and 255 map to %g and %g, want -2 and 2", b.X[0], b.X[1])
	}
	def := DefaultConfig().Normalize
	d.Fill(b, idx[:1], def)
	if math.Abs(float64(b.X[1])-(1-0.2860)/0.3530) > 1e-6 || math.Abs(float64(b.X[0])+0.2860/0.3530) > 1e-6 {
		t.Fatalf("default normalisation: %g %g", b.X[0], b.X[1])
	}
}

func TestFillZeroesUnusedRows(t *testing.T) {
	d := synthDataset()
	norm := Normalize{Mean: 0, Std: 1}
	b := NewBatch(4, d.SampleSize())
	if err := d.Fill(b, []int32{1, 2, 3, 4}, norm); err != nil {
		t.Fatal(err)
	}
	if err := d.Fill(b, []int32{7}, norm); err != nil {
		t.Fatal(err)
	}
	for i, v := range b.X[6:] {
		if v != 0 {
			t.Fatalf("X[%d] = %g after a smaller fill, want 0", 6+i, v)
		}
	}
	for i, v := range b.Y[1:] {
		if v != 0 {
			t.Fatalf("Y[%d] = %d after a smaller fill, want 0", 1+i, v)
		}
	}
	if err := d.Fill(b, nil, norm); err != nil || b.N != 0 {
		t.Fatalf("empty fill: N=%d err=%v", b.N, err)
	}
}

func TestFillRangeMatchesFill(t *testing.T) {
	d := synthDataset()
	norm := Normalize{Mean: 0.3, Std: 0.4}
	a, b := NewBatch(5, 6), NewBatch(5, 6)
	for _, c := range [][2]int{{0, 5}, {7, 5}, {10, 2}, {12, 0}} {
		idx := make([]int32, c[1])
		for k := range idx {
			idx[k] = int32(c[0] + k)
		}
		if err := d.Fill(a, idx, norm); err != nil {
			t.Fatal(err)
		}
		if err := d.FillRange(b, c[0], c[1], norm); err != nil {
			t.Fatal(err)
		}
		if a.N != b.N || string(f32bytes(a.X)) != string(f32bytes(b.X)) || !equalInt32(a.Y, b.Y) {
			t.Fatalf("range %v: FillRange differs from Fill", c)
		}
	}
}

func f32bytes(x []float32) []byte {
	b := make([]byte, 0, 4*len(x))
	for _, v := range x {
		u := math.Float32bits(v)
		b = append(b, byte(u), byte(u>>8), byte(u>>16), byte(u>>24))
	}
	return b
}

func equalInt32(a, b []int32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestFillErrors(t *testing.T) {
	d := synthDataset()
	norm := Normalize{Mean: 0, Std: 1}
	b := NewBatch(3, 6)
	if err := d.Fill(b, []int32{1, 2}, norm); err != nil {
		t.Fatal(err)
	}
	before := append([]float32(nil), b.X...)
	for _, c := range []struct {
		name string
		err  error
		want string
	}{
		{"index past end", d.Fill(b, []int32{0, 12}, norm), "sample index 12 at position 1 is outside [0, 12)"},
		{"negative index", d.Fill(b, []int32{-1}, norm), "sample index -1"},
		{"too many", d.Fill(b, []int32{0, 1, 2, 3}, norm), "4 samples do not fit a batch of capacity 3"},
		{"wrong sample size", d.Fill(NewBatch(3, 5), []int32{0}, norm), "batch rows hold 5 values, samples have 6"},
		{"zero std", d.Fill(b, []int32{0}, Normalize{}), "normalize.std"},
		{"range past end", d.FillRange(b, 10, 3, norm), "samples [10, 13) are outside [0, 12)"},
		{"negative start", d.FillRange(b, -1, 1, norm), "outside"},
		{"range too big", d.FillRange(b, 0, 4, norm), "do not fit"},
		{"hand-built batch", d.Fill(&Batch{Cap: 3, SampleSize: 6}, []int32{0}, norm), "inconsistent batch"},
		{"hand-built dataset", (&Dataset{N: 2, C: 1, H: 2, W: 3}).Fill(b, []int32{0}, norm), "inconsistent dataset"},
	} {
		if c.err == nil || !strings.Contains(c.err.Error(), c.want) || !strings.HasPrefix(c.err.Error(), "data: fill batch: ") {
			t.Errorf("%s: error %v, want one containing %q", c.name, c.err, c.want)
		}
	}
	if b.N != 2 || string(f32bytes(b.X)) != string(f32bytes(before)) {
		t.Fatal("a failed fill changed the batch")
	}
}

func TestFillDoesNotAllocate(t *testing.T) {
	d := synthDataset()
	norm := DefaultConfig().Normalize
	b := NewBatch(8, d.SampleSize())
	idx := []int32{3, 1, 4, 1, 5, 9, 2, 6}
	if a := testing.AllocsPerRun(100, func() { d.Fill(b, idx, norm) }); a != 0 {
		t.Errorf("Fill allocates %v times per call", a)
	}
	if a := testing.AllocsPerRun(100, func() { d.FillRange(b, 2, 7, norm) }); a != 0 {
		t.Errorf("FillRange allocates %v times per call", a)
	}
}

func TestNewBatchPanicsOnBadSize(t *testing.T) {
	defer func() {
		if r := recover(); r == nil || !strings.Contains(r.(string), "must be positive") {
			t.Fatalf("recovered %v", r)
		}
	}()
	NewBatch(0, 784)
}

// BenchmarkFill fills a 256-sample batch of 28x28 images in shuffled order, the per-step work
// of the training loop. SetBytes counts the float32 values written.
func BenchmarkFill(b *testing.B) {
	const n, ss, batch = 4096, 784, 256
	d := &Dataset{Name: FashionMNIST, N: n, C: 1, H: 28, W: 28, Classes: NumClasses, Images: seq(n * ss), Labels: make([]uint8, n)}
	perm := make([]int32, n)
	Permutation(perm, 1, 0)
	bt := NewBatch(batch, ss)
	norm := DefaultConfig().Normalize
	b.SetBytes(batch * ss * 4)
	i := 0
	for b.Loop() {
		if err := d.Fill(bt, perm[i:i+batch], norm); err != nil {
			b.Fatal(err)
		}
		i = (i + batch) % n
	}
}
