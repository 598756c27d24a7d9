package checkpoint

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"os"
	"slices"
	"strconv"
	"unicode/utf8"

	"github.com/qvd/qvd/internal/half"
)

// Limits and constants of the safetensors format.
const (
	// maxHeaderLen is the reference implementation's MAX_HEADER_SIZE: a header longer than
	// this is rejected before any allocation, so a corrupt length prefix cannot make us
	// allocate gigabytes.
	maxHeaderLen = 100_000_000
	// headerAlign: the reference writer pads the header so the data buffer starts at a
	// multiple of 8 bytes, which lets readers map the file and view tensors in place.
	headerAlign = 8
	// metadataKey is the reserved header key for free-form string metadata.
	metadataKey = "__metadata__"
	// dtypeF32 is the only dtype written and decoded.
	dtypeF32 = "F32"
)

// dtypeSizes lists the dtypes the reference implementation defines with a whole number of
// bytes per element. The parser needs every size, not only F32's, to validate the offsets
// of a file that holds other dtypes.
var dtypeSizes = map[string]uint64{
	"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
	"I16": 2, "U16": 2, "F16": 2, "BF16": 2,
	"I32": 4, "U32": 4, "F32": 4,
	"I64": 8, "U64": 8, "F64": 8, "C64": 8,
}

// Errors callers may test for.
var (
	// ErrUnsupportedDtype: the tensor exists but its dtype is not F32.
	ErrUnsupportedDtype = errors.New("unsupported dtype")
	// ErrNoTensor: the file has no tensor of that name.
	ErrNoTensor = errors.New("no such tensor")
)

// Tensor is a named F32 tensor. Data holds the elements in row-major order; a scalar has an
// empty Shape and one element. For writing, Fill may produce the elements instead (Data nil):
// it writes elements [off, off+len(dst)) of the row-major tensor into dst, so a tensor stored
// in another order (a transposed weight) is written without a full-size copy.
type Tensor struct {
	Name  string
	Shape []int
	Data  []float32
	Fill  func(dst []float32, off int)
}

// WriteSafetensors writes tensors, in the given order, and metadata (nil or empty for none)
// to w in the safetensors format. Names must be non-empty, valid UTF-8, unique and not
// "__metadata__"; every dimension must be >= 0 and len(Data) must equal the product of Shape.
func WriteSafetensors(w io.Writer, tensors []Tensor, metadata map[string]string) error {
	header, err := encodeHeader(tensors, metadata)
	if err != nil {
		return fmt.Errorf("write safetensors: %w", err)
	}
	var prefix [8]byte
	binary.LittleEndian.PutUint64(prefix[:], uint64(len(header)))
	if _, err := w.Write(prefix[:]); err != nil {
		return fmt.Errorf("write safetensors header length: %w", err)
	}
	if _, err := w.Write(header); err != nil {
		return fmt.Errorf("write safetensors header: %w", err)
	}
	// Convert through a fixed scratch buffer so writing a large model does not double its
	// memory; 64 KiB amortises the per-Write cost of unbuffered writers.
	var scratch [16 << 10 * 4]byte
	var filled [16 << 10]float32
	for _, t := range tensors {
		if t.Fill != nil {
			n := 1
			for _, d := range t.Shape {
				n *= d
			}
			for off := 0; off < n; {
				k := min(n-off, len(filled))
				t.Fill(filled[:k], off)
				for i, v := range filled[:k] {
					binary.LittleEndian.PutUint32(scratch[4*i:], math.Float32bits(v))
				}
				if _, err := w.Write(scratch[:4*k]); err != nil {
					return fmt.Errorf("write safetensors tensor %q: %w", t.Name, err)
				}
				off += k
			}
			continue
		}
		for data := t.Data; len(data) > 0; {
			n := min(len(data), len(scratch)/4)
			for i, v := range data[:n] {
				binary.LittleEndian.PutUint32(scratch[4*i:], math.Float32bits(v))
			}
			if _, err := w.Write(scratch[:4*n]); err != nil {
				return fmt.Errorf("write safetensors tensor %q: %w", t.Name, err)
			}
			data = data[n:]
		}
	}
	return nil
}

// encodeHeader validates tensors and metadata and returns the padded JSON header. It is
// built by hand rather than with a map so that tensors appear in the caller's order, which
// keeps files byte-for-byte reproducible.
func encodeHeader(tensors []Tensor, metadata map[string]string) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteByte('{')
	first := true
	sep := func() {
		if !first {
			buf.WriteByte(',')
		}
		first = false
	}
	if len(metadata) > 0 {
		keys := make([]string, 0, len(metadata))
		for k, v := range metadata {
			if !utf8.ValidString(k) || !utf8.ValidString(v) {
				return nil, fmt.Errorf("metadata %q: keys and values must be valid UTF-8", k)
			}
			keys = append(keys, k)
		}
		slices.Sort(keys)
		sep()
		buf.WriteString(`"` + metadataKey + `":{`)
		for i, k := range keys {
			if i > 0 {
				buf.WriteByte(',')
			}
			writeJSONString(&buf, k)
			buf.WriteByte(':')
			writeJSONString(&buf, metadata[k])
		}
		buf.WriteByte('}')
	}
	seen := make(map[string]bool, len(tensors))
	var offset uint64
	for i, t := range tensors {
		switch {
		case t.Name == "":
			return nil, fmt.Errorf("tensor %d: empty name", i)
		case t.Name == metadataKey:
			return nil, fmt.Errorf("tensor %d: name %q is reserved", i, t.Name)
		case !utf8.ValidString(t.Name):
			return nil, fmt.Errorf("tensor %d: name %q is not valid UTF-8", i, t.Name)
		case seen[t.Name]:
			return nil, fmt.Errorf("tensor %q: duplicate name", t.Name)
		}
		seen[t.Name] = true
		n, err := shapeElems(t.Shape)
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", t.Name, err)
		}
		if t.Fill != nil && t.Data != nil {
			return nil, fmt.Errorf("tensor %q: both Data and Fill are set", t.Name)
		}
		if t.Fill == nil && n != uint64(len(t.Data)) {
			return nil, fmt.Errorf("tensor %q: shape %v holds %d elements but data has %d", t.Name, t.Shape, n, len(t.Data))
		}
		end := offset + 4*n // cannot overflow: n is the length of a slice in memory
		sep()
		writeJSONString(&buf, t.Name)
		buf.WriteString(`:{"dtype":"F32","shape":[`)
		for j, d := range t.Shape {
			if j > 0 {
				buf.WriteByte(',')
			}
			buf.WriteString(strconv.Itoa(d))
		}
		buf.WriteString(`],"data_offsets":[`)
		buf.WriteString(strconv.FormatUint(offset, 10))
		buf.WriteByte(',')
		buf.WriteString(strconv.FormatUint(end, 10))
		buf.WriteString("]}")
		offset = end
	}
	buf.WriteByte('}')
	for (8+buf.Len())%headerAlign != 0 {
		buf.WriteByte(' ')
	}
	return buf.Bytes(), nil
}

// writeJSONString appends s as a JSON string. s is known to be valid UTF-8, so
// json.Marshal cannot fail or alter it.
func writeJSONString(buf *bytes.Buffer, s string) {
	b, _ := json.Marshal(s)
	buf.Write(b)
}

// shapeElems returns the number of elements of shape, rejecting negative dimensions and
// counts that overflow. A shape with a zero dimension has zero elements whatever the other
// dimensions are, so the product is not computed in that case (it could overflow for a
// perfectly valid empty tensor).
func shapeElems[T int | int64](shape []T) (uint64, error) {
	for i, d := range shape {
		if d < 0 {
			return 0, fmt.Errorf("shape %v: dimension %d is negative", shape, i)
		}
	}
	if slices.Contains(shape, 0) {
		return 0, nil
	}
	n := uint64(1)
	for _, d := range shape {
		hi, lo := bits.Mul64(n, uint64(d))
		if hi != 0 || lo > math.MaxInt64 {
			return 0, fmt.Errorf("shape %v: element count overflows", shape)
		}
		n = lo
	}
	return n, nil
}

// TensorInfo describes a tensor in a parsed file without decoding it.
type TensorInfo struct {
	Dtype string // safetensors dtype string, e.g. "F32", "BF16"
	Shape []int  // empty for a scalar
	Bytes int64  // size of the tensor's data
}

type tensorEntry struct {
	name       string
	dtype      string
	shape      []int
	begin, end uint64 // into File.data
}

// File is a parsed safetensors file. It refers to the byte slice it was parsed from (the
// data is not copied), so that slice must not be modified while the File is in use.
type File struct {
	metadata map[string]string
	entries  []tensorEntry // sorted by data offset
	index    map[string]int
	data     []byte
}

// ParseSafetensors parses and validates a complete safetensors file held in b. Any
// violation of the format is an error; no input makes it panic.
func ParseSafetensors(b []byte) (*File, error) {
	f, err := parseSafetensors(b)
	if err != nil {
		return nil, fmt.Errorf("parse safetensors: %w", err)
	}
	return f, nil
}

func parseSafetensors(b []byte) (*File, error) {
	if len(b) < 8 {
		return nil, fmt.Errorf("file is %d bytes, shorter than the 8-byte header length prefix", len(b))
	}
	n := binary.LittleEndian.Uint64(b[:8])
	if n > maxHeaderLen {
		return nil, fmt.Errorf("header length %d exceeds the limit of %d bytes", n, maxHeaderLen)
	}
	if n > uint64(len(b)-8) {
		return nil, fmt.Errorf("header length %d exceeds the %d bytes after the length prefix (file truncated?)", n, len(b)-8)
	}
	header, data := b[8:8+n], b[8+n:]
	if !utf8.Valid(header) {
		return nil, errors.New("header is not valid UTF-8")
	}
	f := &File{data: data, index: make(map[string]int)}
	if err := f.parseHeader(header); err != nil {
		return nil, fmt.Errorf("header: %w", err)
	}
	if err := f.checkLayout(); err != nil {
		return nil, err
	}
	return f, nil
}

// parseHeader walks the top-level object token by token rather than decoding it into a
// map, because a map would silently keep only the last of two tensors with the same name.
func (f *File) parseHeader(header []byte) error {
	dec := json.NewDecoder(bytes.NewReader(header))
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("invalid JSON: %w", err)
	}
	if tok != json.Delim('{') {
		return errors.New("not a JSON object")
	}
	sawMeta := false
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return fmt.Errorf("invalid JSON: %w", err)
		}
		key, ok := tok.(string)
		if !ok {
			return errors.New("invalid JSON: object key is not a string")
		}
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return fmt.Errorf("invalid JSON at key %q: %w", key, err)
		}
		if key == metadataKey {
			if sawMeta {
				return fmt.Errorf("duplicate key %q", key)
			}
			sawMeta = true
			var md map[string]string
			if err := json.Unmarshal(raw, &md); err != nil {
				return fmt.Errorf("%s must map strings to strings: %w", metadataKey, err)
			}
			f.metadata = md
			continue
		}
		if _, dup := f.index[key]; dup {
			return fmt.Errorf("duplicate tensor %q", key)
		}
		e, err := parseEntry(key, raw)
		if err != nil {
			return fmt.Errorf("tensor %q: %w", key, err)
		}
		f.index[key] = len(f.entries)
		f.entries = append(f.entries, e)
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return fmt.Errorf("invalid JSON: object not closed (%v)", err)
	}
	// The reference parser rejects anything after the object except whitespace (which is
	// how the header is padded).
	rest := header[dec.InputOffset():]
	if len(bytes.Trim(rest, " \t\r\n")) != 0 {
		return fmt.Errorf("invalid JSON: %d unexpected bytes after the header object", len(rest))
	}
	return nil
}

func parseEntry(name string, raw json.RawMessage) (tensorEntry, error) {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil || fields == nil {
		return tensorEntry{}, errors.New("entry is not a JSON object")
	}
	e := tensorEntry{name: name}
	if err := json.Unmarshal(fields["dtype"], &e.dtype); err != nil || fields["dtype"] == nil {
		return e, errors.New(`"dtype" missing or not a string`)
	}
	size, ok := dtypeSizes[e.dtype]
	if !ok {
		return e, fmt.Errorf("unknown dtype %q", e.dtype)
	}
	var shape []int64
	if !isArray(fields["shape"]) || json.Unmarshal(fields["shape"], &shape) != nil {
		return e, errors.New(`"shape" missing or not an array of integers`)
	}
	elems, err := shapeElems(shape)
	if err != nil {
		return e, err
	}
	e.shape = make([]int, len(shape))
	for i, d := range shape {
		e.shape[i] = int(d) // fits: shapeElems bounded the product, so each d, by MaxInt64
	}
	// Raw elements parsed with ParseUint accept exactly the non-negative JSON integers,
	// where json.Number would also accept quoted numbers.
	var offs []json.RawMessage
	if !isArray(fields["data_offsets"]) || json.Unmarshal(fields["data_offsets"], &offs) != nil || len(offs) != 2 {
		return e, errors.New(`"data_offsets" missing or not an array of two integers`)
	}
	for i, p := range []*uint64{&e.begin, &e.end} {
		v, err := strconv.ParseUint(string(offs[i]), 10, 64)
		if err != nil {
			return e, fmt.Errorf("data_offsets [%s, %s]: not non-negative integers", offs[0], offs[1])
		}
		*p = v
	}
	if e.end < e.begin {
		return e, fmt.Errorf("data_offsets [%d, %d]: end before begin", e.begin, e.end)
	}
	hi, want := bits.Mul64(elems, size)
	if hi != 0 {
		return e, fmt.Errorf("%s%v: byte size overflows", e.dtype, e.shape)
	}
	if e.end-e.begin != want {
		return e, fmt.Errorf("data_offsets [%d, %d] span %d bytes, but %s%v needs %d elements × %d bytes",
			e.begin, e.end, e.end-e.begin, e.dtype, e.shape, elems, size)
	}
	return e, nil
}

func isArray(raw json.RawMessage) bool {
	raw = bytes.TrimLeft(raw, " \t\r\n")
	return len(raw) > 0 && raw[0] == '['
}

// checkLayout enforces what the reference loader enforces: sorted by offset, the tensors
// must tile the data buffer exactly, with no gap, no overlap and nothing after the last.
func (f *File) checkLayout() error {
	slices.SortFunc(f.entries, func(a, b tensorEntry) int {
		return cmp.Or(
			cmp.Compare(a.begin, b.begin),
			cmp.Compare(a.end, b.end),
			cmp.Compare(a.name, b.name), // zero-size tensors may share an offset
		)
	})
	var pos uint64
	size := uint64(len(f.data))
	for i, e := range f.entries {
		f.index[e.name] = i
		if e.end > size {
			return fmt.Errorf("tensor %q: data_offsets [%d, %d] beyond the %d-byte data buffer (file truncated?)", e.name, e.begin, e.end, size)
		}
		switch {
		case e.begin > pos:
			return fmt.Errorf("tensor %q: gap in the data buffer: bytes [%d, %d) belong to no tensor", e.name, pos, e.begin)
		case e.begin < pos:
			return fmt.Errorf("tensor %q: data_offsets [%d, %d] overlap the previous tensor, which ends at %d", e.name, e.begin, e.end, pos)
		}
		pos = e.end
	}
	if pos != size {
		return fmt.Errorf("%d trailing bytes after the last tensor (data buffer is %d bytes, tensors cover %d)", size-pos, size, pos)
	}
	return nil
}

// ReadSafetensorsFile reads and parses the safetensors file at path.
func ReadSafetensorsFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read safetensors: %w", err)
	}
	f, err := ParseSafetensors(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return f, nil
}

// Metadata returns a copy of the file's __metadata__ (nil if it has none).
func (f *File) Metadata() map[string]string {
	if f.metadata == nil {
		return nil
	}
	m := make(map[string]string, len(f.metadata))
	for k, v := range f.metadata {
		m[k] = v
	}
	return m
}

// Names returns the tensor names in data-offset order (the order they were written in;
// zero-size tensors sharing an offset are ordered by name).
func (f *File) Names() []string {
	names := make([]string, len(f.entries))
	for i, e := range f.entries {
		names[i] = e.name
	}
	return names
}

func (f *File) entry(name string) (tensorEntry, error) {
	i, ok := f.index[name]
	if !ok {
		return tensorEntry{}, fmt.Errorf("tensor %q: %w", name, ErrNoTensor)
	}
	return f.entries[i], nil
}

// Info describes the named tensor, whatever its dtype.
func (f *File) Info(name string) (TensorInfo, error) {
	e, err := f.entry(name)
	if err != nil {
		return TensorInfo{}, err
	}
	return TensorInfo{Dtype: e.dtype, Shape: slices.Clone(e.shape), Bytes: int64(e.end - e.begin)}, nil
}

func (f *File) f32Entry(name string) (tensorEntry, error) {
	e, err := f.entry(name)
	if err != nil {
		return e, err
	}
	if e.dtype != dtypeF32 {
		return e, fmt.Errorf("tensor %q has dtype %s; only F32 can be decoded (convert it with .float() before saving): %w",
			name, e.dtype, ErrUnsupportedDtype)
	}
	return e, nil
}

// Tensor decodes the named F32 tensor into a newly allocated Tensor: a copy, so it stays
// valid whatever happens to the file's bytes afterwards.
func (f *File) Tensor(name string) (Tensor, error) {
	e, err := f.f32Entry(name)
	if err != nil {
		return Tensor{}, err
	}
	data := make([]float32, (e.end-e.begin)/4)
	decodeF32(data, f.data[e.begin:e.end])
	return Tensor{Name: name, Shape: slices.Clone(e.shape), Data: data}, nil
}

// Widening reports whether a tensor of this dtype can be read into float32 exactly: F32, and
// the half-precision F16 and BF16 that pretrained weights are often published in.
func Widening(dtype string) bool { return dtype == dtypeF32 || dtype == "F16" || dtype == "BF16" }

// ReadInto copies the named tensor into dst as float32, which must have exactly the tensor's
// element count; shape must equal the stored shape. F16 and BF16 tensors are widened (exact).
// It is how a checkpoint is restored into existing flat parameter buffers without allocating.
func (f *File) ReadInto(name string, dst []float32, shape []int) error {
	e, err := f.entry(name)
	if err != nil {
		return err
	}
	if !Widening(e.dtype) {
		return fmt.Errorf("tensor %q has dtype %s; only F32, F16 and BF16 can be decoded (convert it with .float() before saving): %w",
			name, e.dtype, ErrUnsupportedDtype)
	}
	if !slices.Equal(shape, e.shape) {
		return fmt.Errorf("tensor %q: stored shape %v, want %v", name, e.shape, shape)
	}
	size := uint64(4)
	if e.dtype != dtypeF32 {
		size = 2
	}
	if n := (e.end - e.begin) / size; uint64(len(dst)) != n {
		return fmt.Errorf("tensor %q: destination holds %d elements, tensor has %d", name, len(dst), n)
	}
	src := f.data[e.begin:e.end]
	switch e.dtype {
	case dtypeF32:
		decodeF32(dst, src)
	case "F16":
		for i := range dst {
			dst[i] = half.F16ToF32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	default:
		for i := range dst {
			dst[i] = half.BF16ToF32(binary.LittleEndian.Uint16(src[2*i:]))
		}
	}
	return nil
}

func decodeF32(dst []float32, src []byte) {
	for i := range dst {
		dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(src[4*i:]))
	}
}
