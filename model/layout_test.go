package model

import (
	"slices"
	"testing"
)

// TestCanonicalAt: reading a tensor's canonical form a piece at a time, from any offset,
// gives Canonical's result (the checkpoint writer streams transposed weights this way).
func TestCanonicalAt(t *testing.T) {
	spec, err := NewSpec(Config{Type: TypeMLP, Hidden: []int{5, 3}}, []int{1, 2, 3}, 4)
	if err != nil {
		t.Fatal(err)
	}
	l := NewLayout(spec)
	flat := make([]float32, l.Size)
	for i := range flat {
		flat[i] = float32(i)
	}
	transposed := 0
	for _, ts := range l.Tensors {
		want := make([]float32, ts.Size)
		l.Canonical(want, flat, ts)
		for _, chunk := range []int{1, 4, 7, ts.Size} {
			got := make([]float32, ts.Size)
			for off := 0; off < ts.Size; off += chunk {
				l.CanonicalAt(got[off:min(off+chunk, ts.Size)], flat, ts, off)
			}
			if !slices.Equal(got, want) {
				t.Fatalf("%s in chunks of %d: %v, want %v", ts.Name, chunk, got, want)
			}
		}
		if ts.Transposed {
			transposed++
		}
	}
	if transposed == 0 {
		t.Fatal("no transposed tensor exercised")
	}
}
