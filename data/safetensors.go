package data

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// Safetensors datasets (format safetensors) are two files in data.path, train.safetensors and
// test.safetensors, each holding (other tensors are ignored):
//
//	images  U8 or F32, [N, C, H, W] or [N, H, W] (one channel)
//	labels  an integer dtype (U8, I8, U16, I16, U32, I32, U64, I64), [N]
//
// U8 pixels are on [0, 255] like IDX's and are mapped from the file, not read; F32 values are
// taken to be on the [0, 1] scale (pixel/255) and are read into memory. The classes are
// 0..max(training label). The format (huggingface/safetensors): an 8-byte little-endian
// header length n, n bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then
// the data, offsets counted from its start. checkpoint's reader decodes F32 only and reads
// whole files, so this one is separate.

// Names of the files and tensors of a safetensors dataset.
const (
	SafetensorsTrainFile = "train.safetensors"
	SafetensorsTestFile  = "test.safetensors"
	TensorImages         = "images"
	TensorLabels         = "labels"
)

// maxSafetensorsHeader bounds the JSON header, as the reference implementation does.
const maxSafetensorsHeader = 100_000_000

// labelDtypes are the integer dtypes accepted for labels, with their sizes.
var labelDtypes = map[string]int{"U8": 1, "I8": 1, "U16": 2, "I16": 2, "U32": 4, "I32": 4, "U64": 8, "I64": 8}

// stEntry is one tensor of a safetensors header; begin and end are absolute file offsets.
type stEntry struct {
	Dtype   string   `json:"dtype"`
	Shape   []int64  `json:"shape"`
	Offsets []uint64 `json:"data_offsets"`
	begin   int64
	end     int64
}

// stFile is the parsed header of a safetensors dataset file.
type stFile struct {
	path    string
	size    int64
	images  stEntry
	labels  stEntry
	n       int // samples
	c, h, w int
}

// readSafetensorsHeader parses and checks path's header: both tensors present, known dtypes,
// shapes that agree, offsets inside the file that match the shapes. Errors name the file,
// and the tensor, dtype and shape at fault.
func readSafetensorsHeader(path string) (*stFile, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrBadData, path, fmt.Sprintf(format, a...))
	}
	var lenBuf [8]byte
	if _, err := io.ReadFull(f, lenBuf[:]); err != nil {
		return nil, bad("shorter than the 8-byte header length")
	}
	n := binary.LittleEndian.Uint64(lenBuf[:])
	if n > maxSafetensorsHeader || int64(n) > st.Size()-8 {
		return nil, bad("header length %d exceeds the file (%d bytes) or the limit %d", n, st.Size(), maxSafetensorsHeader)
	}
	header := make([]byte, n)
	if _, err := io.ReadFull(f, header); err != nil {
		return nil, bad("truncated header")
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(header, &raw); err != nil {
		return nil, bad("header is not a JSON object: %v", err)
	}
	out := &stFile{path: path, size: st.Size()}
	dataStart, dataLen := int64(8+n), st.Size()-int64(8+n)
	for _, t := range []struct {
		name  string
		entry *stEntry
	}{{TensorImages, &out.images}, {TensorLabels, &out.labels}} {
		r, ok := raw[t.name]
		if !ok {
			names := make([]string, 0, len(raw))
			for k := range raw {
				if k != "__metadata__" {
					names = append(names, k)
				}
			}
			slices.Sort(names)
			return nil, bad("no tensor %q (it holds: %s)", t.name, strings.Join(names, ", "))
		}
		e := t.entry
		if err := json.Unmarshal(r, e); err != nil {
			return nil, bad("tensor %q: %v", t.name, err)
		}
		if len(e.Offsets) != 2 || e.Offsets[1] < e.Offsets[0] || e.Offsets[1] > uint64(dataLen) {
			return nil, bad("tensor %q: data_offsets %v outside the %d-byte data", t.name, e.Offsets, dataLen)
		}
		e.begin, e.end = dataStart+int64(e.Offsets[0]), dataStart+int64(e.Offsets[1])
	}
	im, lb := &out.images, &out.labels
	switch im.Dtype {
	case "U8", "F32":
	default:
		return nil, bad("tensor %q: dtype %s, want U8 (pixels 0-255) or F32 (values on [0, 1])", TensorImages, im.Dtype)
	}
	switch len(im.Shape) {
	case 3:
		out.c = 1
		out.h, out.w = int(im.Shape[1]), int(im.Shape[2])
	case 4:
		out.c, out.h, out.w = int(im.Shape[1]), int(im.Shape[2]), int(im.Shape[3])
	default:
		return nil, bad("tensor %q: shape %v, want [N, C, H, W] or [N, H, W]", TensorImages, im.Shape)
	}
	if im.Shape[0] < 1 || im.Shape[0] > MaxIDXSamples || out.c < 1 || out.c > MaxChannels ||
		out.h < 1 || out.w < 1 || out.h > MaxIDXSide || out.w > MaxIDXSide {
		return nil, bad("tensor %q: shape %v: want 1 to %d samples, 1 to %d channels, sides 1 to %d", TensorImages, im.Shape, MaxIDXSamples, MaxChannels, MaxIDXSide)
	}
	out.n = int(im.Shape[0])
	elem := map[string]int64{"U8": 1, "F32": 4}[im.Dtype]
	if want := int64(out.n*out.c*out.h*out.w) * elem; im.end-im.begin != want {
		return nil, bad("tensor %q: %s%v needs %d bytes, data_offsets %v span %d", TensorImages, im.Dtype, im.Shape, want, im.Offsets, im.end-im.begin)
	}
	lsize, ok := labelDtypes[lb.Dtype]
	if !ok {
		return nil, bad("tensor %q: dtype %s, want an integer dtype (U8, I32, I64, ...)", TensorLabels, lb.Dtype)
	}
	if len(lb.Shape) != 1 || lb.Shape[0] != int64(out.n) {
		return nil, bad("tensor %q: shape %v, want [%d] (one label per image)", TensorLabels, lb.Shape, out.n)
	}
	if want := int64(out.n * lsize); lb.end-lb.begin != want {
		return nil, bad("tensor %q: %s%v needs %d bytes, data_offsets %v span %d", TensorLabels, lb.Dtype, lb.Shape, want, lb.Offsets, lb.end-lb.begin)
	}
	return out, nil
}

// readLabels reads the first keep labels (all when keep is 0), each checked to be in [0,
// MaxClasses).
func (s *stFile) readLabels(keep int) ([]uint8, error) {
	n := s.n
	if keep > 0 {
		n = keep
	}
	size := labelDtypes[s.labels.Dtype]
	buf := make([]byte, n*size)
	f, err := os.Open(s.path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if _, err := f.ReadAt(buf, s.labels.begin); err != nil {
		return nil, fmt.Errorf("%w: %s: reading tensor %q: %v", ErrBadData, s.path, TensorLabels, err)
	}
	out := make([]uint8, n)
	for i := range out {
		b := buf[i*size:][:size]
		var v int64
		switch s.labels.Dtype {
		case "U8":
			v = int64(b[0])
		case "I8":
			v = int64(int8(b[0]))
		case "U16":
			v = int64(binary.LittleEndian.Uint16(b))
		case "I16":
			v = int64(int16(binary.LittleEndian.Uint16(b)))
		case "U32":
			v = int64(binary.LittleEndian.Uint32(b))
		case "I32":
			v = int64(int32(binary.LittleEndian.Uint32(b)))
		case "U64":
			u := binary.LittleEndian.Uint64(b)
			v = int64(min(u, math.MaxInt64))
		case "I64":
			v = int64(binary.LittleEndian.Uint64(b))
		}
		if v < 0 || v >= MaxClasses {
			return nil, fmt.Errorf("%w: %s: tensor %q: label %d at index %d is outside [0, %d)", ErrBadData, s.path, TensorLabels, v, i, MaxClasses)
		}
		out[i] = uint8(v)
	}
	return out, nil
}

// dataset opens the first keep samples (all when 0) of the file as a Dataset: U8 images
// mapped, F32 images read and checked to be finite.
func (s *stFile) dataset(name string, keep int, field string) (*Dataset, error) {
	if keep > s.n {
		return nil, fmt.Errorf("data: %s: %d exceeds the %d samples in %s", field, keep, s.n, s.path)
	}
	labels, err := s.readLabels(keep)
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	n := len(labels)
	ss := s.c * s.h * s.w
	d := &Dataset{Name: name, N: n, C: s.c, H: s.h, W: s.w, Labels: labels}
	f, err := os.Open(s.path)
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	defer f.Close()
	if s.images.Dtype == "U8" {
		m, err := unix.Mmap(int(f.Fd()), 0, int(s.size), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			buf := make([]byte, n*ss) // no mmap: read the pixels instead
			if _, err := f.ReadAt(buf, s.images.begin); err != nil {
				return nil, fmt.Errorf("data: %w: %s: reading tensor %q: %v", ErrBadData, s.path, TensorImages, err)
			}
			d.Images = buf
			return d, nil
		}
		_ = unix.Madvise(m, unix.MADV_RANDOM) // batches read samples in random order
		d.Images, d.Mapped = m[s.images.begin:][:n*ss], s.path
		return d, nil
	}
	buf := make([]byte, n*ss*4)
	if _, err := f.ReadAt(buf, s.images.begin); err != nil {
		return nil, fmt.Errorf("data: %w: %s: reading tensor %q: %v", ErrBadData, s.path, TensorImages, err)
	}
	d.floats = make([]float32, n*ss)
	for i := range d.floats {
		v := math.Float32frombits(binary.LittleEndian.Uint32(buf[4*i:]))
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("data: %w: %s: tensor %q: value %g at sample %d is not finite", ErrBadData, s.path, TensorImages, v, i/ss)
		}
		d.floats[i] = v
	}
	return d, nil
}

// loadSafetensors opens both splits of a safetensors dataset.
func loadSafetensors(cfg Config) (train, test *Dataset, err error) {
	tr, err := readSafetensorsHeader(filepath.Join(cfg.Path, SafetensorsTrainFile))
	if err != nil {
		return nil, nil, fmt.Errorf("data: train: %w", err)
	}
	te, err := readSafetensorsHeader(filepath.Join(cfg.Path, SafetensorsTestFile))
	if err != nil {
		return nil, nil, fmt.Errorf("data: test: %w", err)
	}
	if train, err = tr.dataset(cfg.Dataset, cfg.TrainSubset, "train_subset"); err != nil {
		return nil, nil, err
	}
	if test, err = te.dataset(cfg.Dataset, cfg.TestSubset, "test_subset"); err != nil {
		return nil, nil, err
	}
	all, err := tr.readLabels(0) // the classes are the whole training set's, whatever the subset
	if err != nil {
		return nil, nil, fmt.Errorf("data: %w", err)
	}
	classes := int(slices.Max(all)) + 1
	if i := slices.IndexFunc(test.Labels, func(l uint8) bool { return int(l) >= classes }); i >= 0 {
		return nil, nil, fmt.Errorf("data: %w: %s: tensor %q: label %d at index %d is not a class of the training set (0 to %d)", ErrBadData, te.path, TensorLabels, test.Labels[i], i, classes-1)
	}
	train.Classes, test.Classes = classes, classes
	return train, test, nil
}

// describeSafetensors reads the training file's header and labels.
func describeSafetensors(cfg Config) (Shape, error) {
	tr, err := readSafetensorsHeader(filepath.Join(cfg.Path, SafetensorsTrainFile))
	if err != nil {
		return Shape{}, fmt.Errorf("data: train: %w", err)
	}
	labels, err := tr.readLabels(0)
	if err != nil {
		return Shape{}, fmt.Errorf("data: train: %w", err)
	}
	return Shape{C: tr.c, H: tr.h, W: tr.w, Classes: int(slices.Max(labels)) + 1}, nil
}
