//go:build !cuda

package model

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

func TestSegments(t *testing.T) {
	mlp := Config{Type: TypeMLP, Hidden: []int{256, 128}}
	cnn := Config{Type: TypeCNN, Channels: []int{16, 32}, Kernel: 3, Hidden: []int{128}}
	for _, tc := range []struct {
		cfg  Config
		k    int
		want []int // first layer of each segment
	}{
		// MLP layers: flatten fc1 relu | fc2 relu | fc3.
		{mlp, 1, []int{0}},
		{mlp, 2, []int{0, 3}}, // [flatten fc1 relu] is the widest (784+256+256)
		{mlp, 3, []int{0, 3, 5}},
		// CNN layers: conv1 relu pool | conv2 relu pool flatten | fc1 relu | fc2. conv1's
		// block (3×16×28×28 + ...) outweighs everything after it.
		{cnn, 2, []int{0, 3}},
		{cnn, 3, []int{0, 3, 9}}, // a tie on the largest (conv1's block); the DP keeps the first found
		{cnn, 4, []int{0, 3, 7, 9}},
	} {
		spec, err := NewSpec(tc.cfg, []int{1, 28, 28}, 10)
		if err != nil {
			t.Fatal(err)
		}
		got, err := Segments(spec, tc.k)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s k=%d: segments start at %v, want %v", spec, tc.k, got, tc.want)
		}
	}
	spec, _ := NewSpec(mlp, []int{1, 28, 28}, 10)
	for _, k := range []int{0, 4} {
		if _, err := Segments(spec, k); err == nil {
			t.Errorf("k=%d: no error", k)
		}
	}
}

func TestCheckpointingConfigValidate(t *testing.T) {
	cfg := Config{Type: TypeMLP, Hidden: []int{16, 8}}
	for k, ok := range map[int]bool{-1: false, 0: true, 1: true, 3: true, 4: false} {
		cfg.Recompute.Segments = k
		err := cfg.Validate()
		if (err == nil) != ok {
			t.Errorf("segments %d: error %v, want ok=%v", k, err, ok)
		}
		if err != nil && !strings.HasPrefix(err.Error(), "activation_checkpointing.segments:") {
			t.Errorf("segments %d: error %q does not name the field", k, err)
		}
	}
}

// TestCheckpointingGradientsIdentical checks that the checkpointed step yields the loss and
// gradients of the single graph bit for bit: same operations on the same values, with the
// segment backward seeded by exactly the upstream gradient the single graph computes.
func TestCheckpointingGradientsIdentical(t *testing.T) {
	for _, tc := range []struct {
		cfg      Config
		segments []int
	}{
		{Config{Type: TypeMLP, Hidden: []int{16, 8}}, []int{2, 3}},
		{Config{Type: TypeCNN, Channels: []int{3, 4}, Kernel: 3, Hidden: []int{8}}, []int{2, 3, 4}},
	} {
		for _, f := range []half.Format{half.FP32, half.FP16, half.BF16} {
			for _, k := range tc.segments {
				t.Run(fmt.Sprintf("%s/%s/k%d", tc.cfg.Type, f, k), func(t *testing.T) {
					const micro = 6
					plain := newTestNet(t, tc.cfg, micro, f, 0)
					ckpt := newTestNet(t, tc.cfg, micro, f, k)
					if ckpt.recompute == nil || len(ckpt.recompute.segs) != k {
						t.Fatalf("not checkpointed with %d segments", k)
					}
					size := plain.Layout().Size
					// Two batches accumulated, with a loss scale as under fp16 loss scaling.
					gp, gc := make([]float32, size), make([]float32, size)
					for i, scale := range []float32{1, 1024} {
						b := randomBatch(micro, 64, 4, uint64(11+i))
						lp, err := plain.ForwardBackward(b, scale, FlatSink(gp))
						if err != nil {
							t.Fatal(err)
						}
						lc, err := ckpt.ForwardBackward(b, scale, FlatSink(gc))
						if err != nil {
							t.Fatal(err)
						}
						if math.Float32bits(lp) != math.Float32bits(lc) {
							t.Errorf("batch %d: loss %v, checkpointed %v", i, lp, lc)
						}
					}
					assertSameBits(t, plain.Layout(), gp, gc)

					// Through a sink: same tensors, same values, from the top of the flat space.
					b := randomBatch(micro, 64, 4, 21)
					type chunk struct {
						off int
						g   []float32
					}
					stream := func(n *Net) []chunk {
						rec := &recordSink{mem: make([]float32, n.Layout().Trainable())}
						if _, err := n.ForwardBackward(b, 8, rec); err != nil {
							t.Fatal(err)
						}
						var out []chunk
						for _, p := range rec.pieces {
							out = append(out, chunk{p[0], slices.Clone(rec.mem[p[0]:p[1]])})
						}
						return out
					}
					sp, sc := stream(plain), stream(ckpt)
					if len(sp) != len(sc) || len(sc) != len(ckpt.Layout().Tensors) {
						t.Fatalf("stream: %d tensors, checkpointed %d, layout %d", len(sp), len(sc), len(ckpt.Layout().Tensors))
					}
					for i := range sc {
						if i > 0 && sc[i].off >= sc[i-1].off {
							t.Fatalf("stream: offset %d after %d", sc[i].off, sc[i-1].off)
						}
						if sc[i].off != sp[i].off {
							t.Fatalf("stream %d: offset %d, plain %d", i, sc[i].off, sp[i].off)
						}
						for j := range sc[i].g {
							if math.Float32bits(sc[i].g[j]) != math.Float32bits(sp[i].g[j]) {
								t.Fatalf("stream @%d[%d]: %v, plain %v", sc[i].off, j, sc[i].g[j], sp[i].g[j])
							}
						}
					}
				})
			}
		}
	}
}

// TestCheckpointingReleasesActivations checks that no segment graph keeps a value of an
// intermediate node after a step: only the saved inputs stay.
func TestCheckpointingReleasesActivations(t *testing.T) {
	net := newTestNet(t, Config{Type: TypeCNN, Channels: []int{3, 4}, Kernel: 3, Hidden: []int{8}}, 4, half.FP32, 3)
	grads := make([]float32, net.Layout().Size)
	if _, err := net.ForwardBackward(randomBatch(4, 64, 4, 1), 1, FlatSink(grads)); err != nil {
		t.Fatal(err)
	}
	for i, seg := range net.recompute.segs {
		for _, sg := range []*segGraph{seg.fwd, seg.bwd} {
			if sg == nil {
				continue
			}
			for _, node := range sg.g.AllNodes() {
				if !node.IsVar() && !node.IsScalar() && node.Value() != nil && node.Op() != nil && !strings.HasPrefix(node.Op().String(), "const") {
					t.Errorf("segment %d: %s still holds a value", i, node.Name())
				}
			}
		}
	}
}

func newTestNet(t *testing.T, cfg Config, micro int, f half.Format, segments int) *Net {
	t.Helper()
	spec, err := NewSpec(cfg, []int{1, 8, 8}, 4)
	if err != nil {
		t.Fatal(err)
	}
	layout := NewLayout(spec)
	params := make([]float32, layout.Size)
	Init(spec, layout, params, 7)
	net, err := New(spec, layout, params, Options{MicroBatch: micro, EvalBatch: micro, Grad: f, Segments: segments})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { net.Close() })
	return net
}

func assertSameBits(t *testing.T, l *Layout, want, got []float32) {
	t.Helper()
	nonzero := 0
	for _, ts := range l.Tensors {
		for i := ts.Offset; i < ts.Offset+ts.Size; i++ {
			if math.Float32bits(want[i]) != math.Float32bits(got[i]) {
				t.Fatalf("%s[%d]: plain %v, checkpointed %v", ts.Name, i-ts.Offset, want[i], got[i])
			}
			if want[i] != 0 {
				nonzero++
			}
		}
	}
	if nonzero == 0 {
		t.Fatal("all gradients are zero")
	}
}

// recordSink is a GradSink that lets every piece overwrite one buffer and records the pieces
// in the order they came.
type recordSink struct {
	mem    []float32
	pieces [][2]int
}

func (r *recordSink) Cuts() []int { return nil }

func (r *recordSink) Acquire(lo, hi int) ([]float32, bool, error) { return r.mem[lo:hi], false, nil }

func (r *recordSink) Release(lo, hi int) error {
	r.pieces = append(r.pieces, [2]int{lo, hi})
	return nil
}
