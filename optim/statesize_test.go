package optim

import "testing"

// TestStateElems: the state sizes the estimates use are the optimizers' own: the buffers
// ExportState returns, and the bytes StateBytes counts.
func TestStateElems(t *testing.T) {
	const n = 1000
	for _, c := range []struct {
		typ      string
		momentum float64
		want     int
	}{
		{TypeAdam, 0, 2}, {TypeAdamW, 0.9, 2}, {TypeAdam8bit, 0, 2}, {TypeAdamW8bit, 0, 2}, {TypeSGD, 0.9, 1}, {TypeSGD, 0, 0},
	} {
		cfg := DefaultConfig()
		cfg.Type, cfg.Momentum = c.typ, c.momentum
		got, err := StateElems(cfg)
		if err != nil || got != c.want {
			t.Errorf("%s momentum %v: %d, %v; want %d", c.typ, c.momentum, got, err, c.want)
		}
		o, err := New(cfg, n)
		if err != nil {
			t.Fatal(err)
		}
		if bufs := ExportState(o); len(bufs) != got {
			t.Errorf("%s momentum %v: StateElems %d, the optimizer keeps %d buffers", c.typ, c.momentum, got, len(bufs))
		}
		want := int64(4 * got * n)
		if QuantizedState(cfg) {
			want = QuantizedStateBytes(got, n)
		}
		if b := StateBytes(o); b != want {
			t.Errorf("%s: StateBytes %d, want %d from StateElems and QuantizedState", c.typ, b, want)
		}
		o.Close()
	}
	if _, err := StateElems(Config{Type: "lamb"}); err == nil {
		t.Error("an unknown optimizer has a state size")
	}
}
