package model

import (
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

// rawST writes a safetensors file whose tensors are stored in the given dtypes (F32, F16,
// BF16 or, to check the refusal, I64), as PyTorch or timm publish them.
func rawST(t *testing.T, l *Layout, dtype func(name string) string, value func(i int) float32) string {
	t.Helper()
	header := map[string]any{}
	var data []byte
	for _, tt := range l.Tensors {
		dt := dtype(tt.Name)
		begin := len(data)
		for i := 0; i < tt.Size; i++ {
			v := value(i)
			switch dt {
			case "F32":
				data = binary.LittleEndian.AppendUint32(data, math.Float32bits(v))
			case "F16":
				data = binary.LittleEndian.AppendUint16(data, half.F32ToF16(v))
			case "BF16":
				data = binary.LittleEndian.AppendUint16(data, half.F32ToBF16(v))
			case "I64":
				data = binary.LittleEndian.AppendUint64(data, uint64(int64(v)))
			}
		}
		header[tt.Name] = map[string]any{"dtype": dt, "shape": tt.Shape, "data_offsets": []int{begin, len(data)}}
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
	p := filepath.Join(t.TempDir(), "w.safetensors")
	if err := os.WriteFile(p, out, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// Half-precision weights (F16, BF16) load widened to fp32, exactly; an integer tensor is an
// error naming it and its dtype.
func TestInitFromHalfPrecision(t *testing.T) {
	_, l := initSpec(t, 3)
	value := func(i int) float32 { return float32(i%64)*0.25 - 4 } // exact in F16 and BF16
	alternate := func(name string) string {
		if strings.HasSuffix(name, ".bias") {
			return "BF16"
		}
		return "F16"
	}
	flat := make([]float32, l.Size)
	rep, err := LoadInit(InitConfig{From: rawST(t, l, alternate, value), Strict: true}, l, flat)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Loaded) != len(l.Tensors) {
		t.Fatalf("loaded %d of %d tensors", len(rep.Loaded), len(l.Tensors))
	}
	buf := make([]float32, 0)
	for _, tt := range l.Tensors {
		buf = append(buf[:0], make([]float32, tt.Size)...)
		l.Canonical(buf, flat, tt)
		for i, v := range buf {
			if v != value(i) {
				t.Fatalf("%s[%d] = %v, want %v", tt.Name, i, v, value(i))
			}
		}
	}
	ints := func(name string) string {
		if name == "fc1.weight" {
			return "I64"
		}
		return "F32"
	}
	_, err = LoadInit(InitConfig{From: rawST(t, l, ints, value), Strict: true}, l, make([]float32, l.Size))
	if err == nil || !strings.Contains(err.Error(), `tensor fc1.weight: the file's "fc1.weight" has dtype I64; only F32, F16 and BF16 load`) {
		t.Fatalf("error %v", err)
	}
}
