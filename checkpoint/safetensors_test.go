package checkpoint

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// sampleTensors covers the shapes that trip up writers: a matrix, a scalar (shape [], one
// element), tensors with a zero dimension (no data), and special float values whose bits
// must survive unchanged.
func sampleTensors() []Tensor {
	return []Tensor{
		{Name: "layer.0.weight", Shape: []int{2, 3}, Data: []float32{1, -2, 3.5, 0, 1e-30, -1e30}},
		{Name: "layer.0.bias", Shape: []int{3}, Data: []float32{float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.Copysign(0, -1))}},
		{Name: "scale", Shape: []int{}, Data: []float32{0.125}},
		{Name: "empty", Shape: []int{0, 4}, Data: []float32{}},
		{Name: "empty.middle", Shape: []int{3, 0, 2}, Data: nil},
		{Name: "nan", Shape: []int{1, 1}, Data: []float32{math.Float32frombits(0x7fc00001)}},
		{Name: "ünïcode ⊗", Shape: []int{2}, Data: []float32{7, 8}},
	}
}

func encode(t testing.TB, tensors []Tensor, md map[string]string) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := WriteSafetensors(&buf, tensors, md); err != nil {
		t.Fatalf("WriteSafetensors: %v", err)
	}
	return buf.Bytes()
}

func sameBits(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

func TestSafetensorsRoundTrip(t *testing.T) {
	in := sampleTensors()
	md := map[string]string{"format": "pt", "qvd.step": "400", "quote\"and\\slash": "<&>"}
	b := encode(t, in, md)

	f, err := ParseSafetensors(b)
	if err != nil {
		t.Fatalf("ParseSafetensors: %v", err)
	}
	if got := f.Metadata(); len(got) != len(md) || got["qvd.step"] != "400" || got["quote\"and\\slash"] != "<&>" {
		t.Errorf("Metadata() = %v, want %v", got, md)
	}
	// Zero-size tensors share an offset with the tensor after them; within one offset the
	// order is by name, so compare as sets plus check the non-empty order.
	names := f.Names()
	if len(names) != len(in) {
		t.Fatalf("Names() = %v, want %d names", names, len(in))
	}
	var nonEmpty []string
	for _, n := range names {
		if info, _ := f.Info(n); info.Bytes > 0 {
			nonEmpty = append(nonEmpty, n)
		}
	}
	if want := []string{"layer.0.weight", "layer.0.bias", "scale", "nan", "ünïcode ⊗"}; !slices.Equal(nonEmpty, want) {
		t.Errorf("non-empty tensors in offset order = %v, want %v", nonEmpty, want)
	}
	for _, want := range in {
		got, err := f.Tensor(want.Name)
		if err != nil {
			t.Fatalf("Tensor(%q): %v", want.Name, err)
		}
		if got.Name != want.Name || !slices.Equal(got.Shape, want.Shape) || !sameBits(got.Data, want.Data) {
			t.Errorf("Tensor(%q) = %+v, want %+v", want.Name, got, want)
		}
		if got.Shape == nil {
			t.Errorf("Tensor(%q).Shape is nil; a scalar's shape should be empty, not nil", want.Name)
		}
		dst := make([]float32, len(want.Data))
		if err := f.ReadInto(want.Name, dst, want.Shape); err != nil {
			t.Fatalf("ReadInto(%q): %v", want.Name, err)
		}
		if !sameBits(dst, want.Data) {
			t.Errorf("ReadInto(%q) = %v, want %v", want.Name, dst, want.Data)
		}
		info, err := f.Info(want.Name)
		if err != nil || info.Dtype != "F32" || !slices.Equal(info.Shape, want.Shape) || info.Bytes != int64(4*len(want.Data)) {
			t.Errorf("Info(%q) = %+v, %v", want.Name, info, err)
		}
	}

	// Tensor returns a copy: changing the file's bytes afterwards must not change it.
	got, _ := f.Tensor("layer.0.weight")
	clear(b)
	if got.Data[0] != 1 {
		t.Errorf("Tensor data changed with the underlying bytes; it should be a copy")
	}
}

func TestSafetensorsNoMetadataNoTensors(t *testing.T) {
	b := encode(t, nil, nil)
	// The reference writer's output for an empty file: "{}" padded to 8 bytes.
	want := append(le64(8), "{}      "...)
	if !bytes.Equal(b, want) {
		t.Fatalf("empty file = %q, want %q", b, want)
	}
	f, err := ParseSafetensors(b)
	if err != nil {
		t.Fatal(err)
	}
	if f.Metadata() != nil || len(f.Names()) != 0 {
		t.Errorf("empty file parsed to metadata %v, names %v", f.Metadata(), f.Names())
	}
}

func le64(n uint64) []byte { return binary.LittleEndian.AppendUint64(nil, n) }

func f32le(vs ...float32) []byte {
	var b []byte
	for _, v := range vs {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(v))
	}
	return b
}

// TestSafetensorsBytes checks our output byte for byte against the layout, using the
// expected outputs of the reference implementation's own serialization tests.
func TestSafetensorsBytes(t *testing.T) {
	tests := []struct {
		name    string
		tensors []Tensor
		md      map[string]string
		header  string // unpadded JSON
		padded  int    // header length after padding
		data    []byte
	}{
		{
			name:    "reference attn.0",
			tensors: []Tensor{{Name: "attn.0", Shape: []int{1, 2, 3}, Data: []float32{0, 1, 2, 3, 4, 5}}},
			header:  `{"attn.0":{"dtype":"F32","shape":[1,2,3],"data_offsets":[0,24]}}`,
			padded:  64, // already a multiple of 8: no padding
			data:    f32le(0, 1, 2, 3, 4, 5),
		},
		{
			name:    "reference attn0 needs padding",
			tensors: []Tensor{{Name: "attn0", Shape: []int{1, 1, 2, 3}, Data: []float32{0, 1, 2, 3, 4, 5}}},
			header:  `{"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}}`,
			padded:  72,
			data:    f32le(0, 1, 2, 3, 4, 5),
		},
		{
			name:   "reference metadata only",
			md:     map[string]string{"framework": "pt"},
			header: `{"__metadata__":{"framework":"pt"}}`,
			padded: 40,
		},
		{
			name: "two tensors and a scalar, in the given order",
			tensors: []Tensor{
				{Name: "b", Shape: []int{2}, Data: []float32{1, -2}},
				{Name: "a", Shape: []int{}, Data: []float32{0.5}},
			},
			md:     map[string]string{"z": "1", "a": "2"},
			header: `{"__metadata__":{"a":"2","z":"1"},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[],"data_offsets":[8,12]}}`,
			padded: 144,
			data:   f32le(1, -2, 0.5),
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := encode(t, tc.tensors, tc.md)
			want := le64(uint64(tc.padded))
			want = append(want, tc.header...)
			want = append(want, strings.Repeat(" ", tc.padded-len(tc.header))...)
			want = append(want, tc.data...)
			if !bytes.Equal(b, want) {
				t.Fatalf("bytes:\n got %q\nwant %q", b, want)
			}
			if (8+tc.padded)%8 != 0 {
				t.Fatalf("test case header length %d does not align the data", tc.padded)
			}
		})
	}
}

// TestParseReferenceFiles parses files exactly as the reference implementation's Python
// tests write them, including an older, unpadded header and a non-F32 dtype.
func TestParseReferenceFiles(t *testing.T) {
	zeros16 := make([]byte, 16)
	unpadded := append(le64(60), `{"test":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}`...)
	unpadded = append(unpadded, zeros16...)
	withMeta := append(le64(102), `{"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}       `...)
	withMeta = append(withMeta, zeros16...)

	for name, b := range map[string][]byte{"unpadded": unpadded, "with metadata": withMeta} {
		f, err := ParseSafetensors(b)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		n := f.Names()[0]
		info, err := f.Info(n)
		if err != nil || info.Dtype != "I32" || !slices.Equal(info.Shape, []int{2, 2}) || info.Bytes != 16 {
			t.Errorf("%s: Info(%q) = %+v, %v", name, n, info, err)
		}
		if _, err := f.Tensor(n); !errors.Is(err, ErrUnsupportedDtype) || !strings.Contains(err.Error(), "I32") {
			t.Errorf("%s: Tensor(%q) of an I32 tensor: err = %v, want ErrUnsupportedDtype naming I32", name, n, err)
		}
	}
}

func TestTensorErrors(t *testing.T) {
	f16 := header(`{"h":{"dtype":"F16","shape":[2],"data_offsets":[0,4]}}`, []byte{0, 0x3c, 0, 0x40})
	f, err := ParseSafetensors(f16)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.Tensor("h"); !errors.Is(err, ErrUnsupportedDtype) || !strings.Contains(err.Error(), "F16") {
		t.Errorf("Tensor of F16: err = %v, want ErrUnsupportedDtype naming F16", err)
	}
	// ReadInto widens half precision (pretrained weights are often published in it).
	if h := make([]float32, 2); f.ReadInto("h", h, []int{2}) != nil || h[0] != 1 || h[1] != 2 {
		t.Errorf("ReadInto of F16 [1, 2]: got %v", h)
	}
	i32, err := ParseSafetensors(header(`{"i":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}`, []byte{1, 0, 0, 0}))
	if err != nil {
		t.Fatal(err)
	}
	if err := i32.ReadInto("i", make([]float32, 1), []int{1}); !errors.Is(err, ErrUnsupportedDtype) || !strings.Contains(err.Error(), "I32") {
		t.Errorf("ReadInto of I32: err = %v, want ErrUnsupportedDtype naming I32", err)
	}

	g, err := ParseSafetensors(encode(t, sampleTensors(), nil))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := g.Tensor("missing"); !errors.Is(err, ErrNoTensor) {
		t.Errorf("Tensor(missing): err = %v, want ErrNoTensor", err)
	}
	if _, err := g.Info("missing"); !errors.Is(err, ErrNoTensor) {
		t.Errorf("Info(missing): err = %v, want ErrNoTensor", err)
	}
	for _, tc := range []struct {
		name  string
		dst   []float32
		shape []int
		want  string
	}{
		{"transposed shape", make([]float32, 6), []int{3, 2}, "stored shape [2 3], want [3 2]"},
		{"flattened shape", make([]float32, 6), []int{6}, "stored shape"},
		{"short destination", make([]float32, 5), []int{2, 3}, "destination holds 5 elements"},
		{"long destination", make([]float32, 7), []int{2, 3}, "destination holds 7 elements"},
	} {
		err := g.ReadInto("layer.0.weight", tc.dst, tc.shape)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ReadInto %s: err = %v, want it to contain %q", tc.name, err, tc.want)
		}
	}
	if err := g.ReadInto("scale", make([]float32, 1), nil); err != nil {
		t.Errorf("ReadInto of a scalar with a nil shape: %v", err)
	}
}

func TestWriteSafetensorsRejects(t *testing.T) {
	tests := []struct {
		name    string
		tensors []Tensor
		md      map[string]string
		want    string
	}{
		{"empty name", []Tensor{{Name: "", Shape: []int{1}, Data: []float32{1}}}, nil, "empty name"},
		{"duplicate", []Tensor{{Name: "a", Shape: []int{}, Data: []float32{1}}, {Name: "a", Shape: []int{}, Data: []float32{1}}}, nil, `"a": duplicate`},
		{"reserved name", []Tensor{{Name: "__metadata__", Shape: []int{}, Data: []float32{1}}}, nil, "reserved"},
		{"too few elements", []Tensor{{Name: "a", Shape: []int{2, 2}, Data: []float32{1, 2, 3}}}, nil, "holds 4 elements but data has 3"},
		{"too many elements", []Tensor{{Name: "a", Shape: []int{}, Data: []float32{1, 2}}}, nil, "holds 1 elements but data has 2"},
		{"negative dim", []Tensor{{Name: "a", Shape: []int{2, -1}, Data: nil}}, nil, "negative"},
		{"overflowing shape", []Tensor{{Name: "a", Shape: []int{1 << 40, 1 << 40}, Data: nil}}, nil, "overflows"},
		{"invalid UTF-8 name", []Tensor{{Name: "a\xff", Shape: []int{}, Data: []float32{1}}}, nil, "UTF-8"},
		{"invalid UTF-8 metadata", nil, map[string]string{"k": "\xfe"}, "UTF-8"},
	}
	for _, tc := range tests {
		var buf bytes.Buffer
		err := WriteSafetensors(&buf, tc.tensors, tc.md)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want it to contain %q", tc.name, err, tc.want)
		}
		if buf.Len() != 0 {
			t.Errorf("%s: wrote %d bytes before failing validation", tc.name, buf.Len())
		}
	}
}

// header builds a file from a raw header (padded) and a data buffer, so each malformed case
// below differs from a valid file in exactly one way.
func header(h string, data []byte) []byte {
	for (8+len(h))%8 != 0 {
		h += " "
	}
	b := append(le64(uint64(len(h))), h...)
	return append(b, data...)
}

func TestParseSafetensorsRejects(t *testing.T) {
	valid := `{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`
	if _, err := ParseSafetensors(header(valid, make([]byte, 8))); err != nil {
		t.Fatalf("the base case should parse: %v", err)
	}
	two := func(a, b string) string {
		return `{"a":{"dtype":"F32","shape":[1],"data_offsets":` + a + `},"b":{"dtype":"F32","shape":[1],"data_offsets":` + b + `}}`
	}
	tests := []struct {
		name string
		b    []byte
		want string
	}{
		{"empty file", nil, "shorter than the 8-byte"},
		{"short prefix", []byte{1, 0, 0}, "shorter than the 8-byte"},
		{"header longer than file", append(le64(1000), "{}"...), "header length 1000 exceeds the 2 bytes"},
		{"absurd header length", append(le64(1<<62), "{}"...), "exceeds the limit"},
		{"header length just over the limit", append(le64(100_000_001), "{}"...), "exceeds the limit"},
		{"invalid UTF-8", header("{\"\xff\":1}", nil), "not valid UTF-8"},
		{"not JSON", header("hello", nil), "invalid JSON"},
		{"truncated JSON", header(`{"a":{"dtype":"F32"`, nil), "invalid JSON"},
		{"JSON array", header(`[1,2]`, nil), "not a JSON object"},
		{"unclosed object", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}`, make([]byte, 8)), "invalid JSON"},
		{"garbage after object", header(valid+"x", make([]byte, 8)), "unexpected bytes after"},
		{"second object", header(valid+"{}", make([]byte, 8)), "unexpected bytes after"},
		{"entry not an object", header(`{"a":[1]}`, nil), "not a JSON object"},
		{"missing dtype", header(`{"a":{"shape":[2],"data_offsets":[0,8]}}`, make([]byte, 8)), `"dtype" missing`},
		{"unknown dtype", header(`{"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}}`, make([]byte, 8)), `unknown dtype "F31"`},
		{"lowercase dtype", header(`{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}`, make([]byte, 8)), "unknown dtype"},
		{"missing shape", header(`{"a":{"dtype":"F32","data_offsets":[0,8]}}`, make([]byte, 8)), `"shape" missing`},
		{"null shape", header(`{"a":{"dtype":"F32","shape":null,"data_offsets":[0,8]}}`, make([]byte, 8)), `"shape" missing`},
		{"negative dim", header(`{"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}`, make([]byte, 8)), "negative"},
		{"fractional dim", header(`{"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,10]}}`, make([]byte, 10)), "not an array of integers"},
		{"huge dim", header(`{"a":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}}`, make([]byte, 8)), "not an array of integers"},
		{"overflowing shape", header(`{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}}`, make([]byte, 8)), "overflows"},
		{"shape × dtype overflows", header(`{"a":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}}`, make([]byte, 8)), "byte size overflows"},
		{"missing offsets", header(`{"a":{"dtype":"F32","shape":[2]}}`, make([]byte, 8)), `"data_offsets" missing`},
		{"three offsets", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}}`, make([]byte, 8)), "two integers"},
		{"quoted offsets", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":["0","8"]}}`, make([]byte, 8)), "not non-negative integers"},
		{"negative offset", header(`{"a":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}}`, make([]byte, 8)), "not non-negative integers"},
		{"end before begin", header(`{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}`, make([]byte, 8)), "end before begin"},
		{"size mismatch", header(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}`, make([]byte, 8)), "span 8 bytes, but F32[3] needs 3 elements × 4 bytes"},
		{"offsets beyond buffer", header(valid, make([]byte, 4)), "beyond the 4-byte data buffer"},
		{"gap at start", header(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, make([]byte, 8)), "gap in the data buffer: bytes [0, 4)"},
		{"gap between", header(two("[0,4]", "[8,12]"), make([]byte, 12)), "gap in the data buffer: bytes [4, 8)"},
		{"overlap", header(two("[0,4]", "[2,6]"), make([]byte, 6)), "overlap the previous tensor"},
		{"same bytes twice", header(two("[0,4]", "[0,4]"), make([]byte, 4)), "overlap"},
		{"trailing bytes", header(valid, make([]byte, 9)), "1 trailing bytes"},
		{"duplicate tensor", header(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, make([]byte, 8)), `duplicate tensor "a"`},
		{"metadata not strings", header(`{"__metadata__":{"k":1}}`, nil), "must map strings to strings"},
		{"metadata twice", header(`{"__metadata__":{},"__metadata__":{}}`, nil), "duplicate key"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := ParseSafetensors(tc.b)
			if err == nil {
				t.Fatalf("parsed (names %v), want an error containing %q", f.Names(), tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to contain %q", err, tc.want)
			}
			t.Log(err) // go test -v shows every message, to review them for clarity
		})
	}
}

func TestParseAcceptsEdgeCases(t *testing.T) {
	for name, b := range map[string][]byte{
		// Zero-size tensors sharing an offset, out of name order in the header.
		"zero-size tensors at one offset": header(`{"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":{"dtype":"BF16","shape":[5,0],"data_offsets":[4,4]}}`, make([]byte, 4)),
		// A huge dimension times zero is an empty tensor, not an overflow.
		"huge dim times zero":  header(`{"a":{"dtype":"F32","shape":[9223372036854775807,9223372036854775807,0],"data_offsets":[0,0]}}`, nil),
		"null metadata":        header(`{"__metadata__":null}`, nil),
		"unknown entry fields": header(`{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3],"extra":true}}`, make([]byte, 3)),
		"whitespace":           header(" \n{ \"a\" : { \"dtype\" : \"I8\" , \"shape\" : [ 1 ] , \"data_offsets\" : [ 0 , 1 ] } }\t\r\n", make([]byte, 1)),
	} {
		if _, err := ParseSafetensors(b); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestReadSafetensorsFile(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.safetensors")
	if err := os.WriteFile(good, encode(t, sampleTensors(), nil), 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := ReadSafetensorsFile(good)
	if err != nil {
		t.Fatal(err)
	}
	if len(f.Names()) != len(sampleTensors()) {
		t.Errorf("Names() = %v", f.Names())
	}

	bad := filepath.Join(dir, "bad.safetensors")
	b := encode(t, sampleTensors(), nil)
	if err := os.WriteFile(bad, b[:len(b)-1], 0o644); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{bad, filepath.Join(dir, "missing.safetensors")} {
		if _, err := ReadSafetensorsFile(p); err == nil || !strings.Contains(err.Error(), p) {
			t.Errorf("ReadSafetensorsFile(%s): err = %v, want it to name the path", p, err)
		}
	}
}

// FuzzParseSafetensors checks that no input makes the parser panic, and that whatever it
// accepts is consistent: every tensor decodes (or reports an unsupported dtype), and an
// all-F32 file survives a write/parse round trip unchanged.
func FuzzParseSafetensors(f *testing.F) {
	valid := encode(f, sampleTensors(), map[string]string{"k": "v"})
	f.Add(valid)
	f.Add(encode(f, nil, nil))
	f.Add(valid[:len(valid)-3])              // truncated data
	f.Add(append(slices.Clone(valid), 0))    // trailing byte
	f.Add(valid[:20])                        // truncated header
	f.Add(append(le64(1<<40), valid[8:]...)) // absurd length
	f.Add(append(le64(0), valid[8:]...))     // zero length
	f.Add(header(`{"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]}}`, make([]byte, 6)))
	f.Add(header(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}`, make([]byte, 6)))
	f.Add(header(`{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}}`, nil))
	flipped := slices.Clone(valid)
	flipped[30] ^= 0x20
	f.Add(flipped)

	f.Fuzz(func(t *testing.T, b []byte) {
		file, err := ParseSafetensors(b)
		if err != nil {
			return
		}
		allF32 := true
		var tensors []Tensor
		for _, name := range file.Names() {
			info, err := file.Info(name)
			if err != nil {
				t.Fatalf("Info(%q) of a listed name: %v", name, err)
			}
			tensor, err := file.Tensor(name)
			if info.Dtype != "F32" {
				allF32 = false
				if !errors.Is(err, ErrUnsupportedDtype) {
					t.Fatalf("Tensor(%q) of dtype %s: err = %v", name, info.Dtype, err)
				}
				continue
			}
			if err != nil {
				t.Fatalf("Tensor(%q): %v", name, err)
			}
			if int64(4*len(tensor.Data)) != info.Bytes {
				t.Fatalf("Tensor(%q) has %d elements for %d bytes", name, len(tensor.Data), info.Bytes)
			}
			tensors = append(tensors, tensor)
		}
		if !allF32 {
			return
		}
		var buf bytes.Buffer
		if err := WriteSafetensors(&buf, tensors, file.Metadata()); err != nil {
			t.Fatalf("rewriting an accepted file: %v", err)
		}
		again, err := ParseSafetensors(buf.Bytes())
		if err != nil {
			t.Fatalf("parsing a rewritten file: %v", err)
		}
		if !slices.Equal(again.Names(), file.Names()) {
			t.Fatalf("names after a round trip: %v, want %v", again.Names(), file.Names())
		}
		for _, want := range tensors {
			got, err := again.Tensor(want.Name)
			if err != nil || !slices.Equal(got.Shape, want.Shape) || !sameBits(got.Data, want.Data) {
				t.Fatalf("tensor %q changed in a round trip: %+v, %v", want.Name, got, err)
			}
		}
	})
}

func BenchmarkWriteSafetensors(b *testing.B) {
	data := make([]float32, 1<<20)
	tensors := []Tensor{{Name: "w", Shape: []int{len(data)}, Data: data}}
	b.SetBytes(int64(4 * len(data)))
	for b.Loop() {
		if err := WriteSafetensors(io.Discard, tensors, nil); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkReadInto(b *testing.B) {
	data := make([]float32, 1<<20)
	var buf bytes.Buffer
	if err := WriteSafetensors(&buf, []Tensor{{Name: "w", Shape: []int{len(data)}, Data: data}}, nil); err != nil {
		b.Fatal(err)
	}
	f, err := ParseSafetensors(buf.Bytes())
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(4 * len(data)))
	for b.Loop() {
		if err := f.ReadInto("w", data, []int{len(data)}); err != nil {
			b.Fatal(err)
		}
	}
}

// failAfter accepts n bytes, then fails every write.
type failAfter struct{ n int }

var errWriterFull = errors.New("writer full")

func (w *failAfter) Write(p []byte) (int, error) {
	if len(p) > w.n {
		k := w.n
		w.n = 0
		return k, errWriterFull
	}
	w.n -= len(p)
	return len(p), nil
}

func TestWriteSafetensorsWriterError(t *testing.T) {
	tensors := sampleTensors()
	size := len(encode(t, tensors, nil))
	for _, n := range []int{0, 4, 8, 20, size - 1} {
		err := WriteSafetensors(&failAfter{n: n}, tensors, nil)
		if !errors.Is(err, errWriterFull) {
			t.Errorf("writer failing after %d of %d bytes: err = %v", n, size, err)
		}
	}
}

// TestSafetensorsFill: a tensor produced by Fill (in pieces, from a larger tensor than the
// writer's scratch) writes the same bytes as the same tensor given as Data; both set is an
// error.
func TestSafetensorsFill(t *testing.T) {
	const n = 40_000 // more than the writer's 16 Ki-element scratch: several Fill calls
	data := make([]float32, n)
	for i := range data {
		data[i] = float32(i) * 0.5
	}
	calls := 0
	filled := Tensor{Name: "w", Shape: []int{200, 200}, Fill: func(dst []float32, off int) {
		calls++
		copy(dst, data[off:])
	}}
	plain := Tensor{Name: "w", Shape: []int{200, 200}, Data: data}
	if a, b := encode(t, []Tensor{filled}, nil), encode(t, []Tensor{plain}, nil); !bytes.Equal(a, b) {
		t.Fatal("Fill wrote other bytes than Data")
	}
	if calls < 3 {
		t.Fatalf("Fill called %d times for %d elements", calls, n)
	}
	filled.Data = data
	if err := WriteSafetensors(io.Discard, []Tensor{filled}, nil); err == nil || !strings.Contains(err.Error(), "both Data and Fill") {
		t.Fatalf("Data and Fill both set: %v", err)
	}
}
