package data

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// idxBytes builds an IDX stream: magic, big-endian dims, payload.
func idxBytes(magic uint32, dims []uint32, payload []byte) []byte {
	var buf bytes.Buffer
	binary.Write(&buf, binary.BigEndian, magic)
	for _, d := range dims {
		binary.Write(&buf, binary.BigEndian, d)
	}
	buf.Write(payload)
	return buf.Bytes()
}

func gzipBytes(t testing.TB, raw []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	if _, err := zw.Write(raw); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func writeFile(t testing.TB, path string, b []byte) string {
	t.Helper()
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// seq returns n bytes with a pattern that catches misplaced rows: byte i is (i*7+3) mod 251.
func seq(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte((i*7 + 3) % 251)
	}
	return b
}

func TestReadIDXRoundTrip(t *testing.T) {
	dir := t.TempDir()
	pix := seq(5 * 3 * 4)
	labels := []byte{0, 9, 3, 3, 7}
	for _, gz := range []bool{false, true} {
		img := idxBytes(MagicIDXImages, []uint32{5, 3, 4}, pix)
		lab := idxBytes(MagicIDXLabels, []uint32{5}, labels)
		name := "raw"
		if gz {
			img, lab, name = gzipBytes(t, img), gzipBytes(t, lab), "gz"
		}
		ip := writeFile(t, filepath.Join(dir, name+"-images"), img)
		lp := writeFile(t, filepath.Join(dir, name+"-labels"), lab)

		n, rows, cols, got, err := ReadIDXImages(ip)
		if err != nil {
			t.Fatalf("%s: ReadIDXImages: %v", name, err)
		}
		if n != 5 || rows != 3 || cols != 4 || !bytes.Equal(got, pix) {
			t.Fatalf("%s: got n=%d rows=%d cols=%d pix=%v", name, n, rows, cols, got)
		}
		if cap(got) != len(got) {
			t.Errorf("%s: pixel buffer has capacity %d for %d bytes", name, cap(got), len(got))
		}
		gotLabels, err := ReadIDXLabels(lp)
		if err != nil || !bytes.Equal(gotLabels, labels) {
			t.Fatalf("%s: ReadIDXLabels = %v, %v", name, gotLabels, err)
		}
	}
}

// TestReadPayloadLarge reads a payload bigger than the first growth step, through gzip, so
// the buffer-growing path is exercised.
func TestReadPayloadLarge(t *testing.T) {
	pix := seq(300 * 28 * 28) // 235200 bytes: several doublings of the 64 KiB first chunk
	p := writeFile(t, filepath.Join(t.TempDir(), "img.gz"), gzipBytes(t, idxBytes(MagicIDXImages, []uint32{300, 28, 28}, pix)))
	n, _, _, got, err := ReadIDXImages(p)
	if err != nil || n != 300 || !bytes.Equal(got, pix) || cap(got) != len(pix) {
		t.Fatalf("n=%d len=%d cap=%d err=%v", n, len(got), cap(got), err)
	}
}

type corruptCase struct {
	name   string
	images bool   // read with ReadIDXImages (else ReadIDXLabels)
	file   []byte // file content
	want   string // substring of the error
}

func corruptCases(t testing.TB) []corruptCase {
	good := idxBytes(MagicIDXImages, []uint32{4, 2, 3}, seq(24))
	goodGz := gzipBytes(t, good)
	badCRC := bytes.Clone(goodGz)
	badCRC[len(badCRC)-8] ^= 0xff // CRC-32 is the trailer's first 4 bytes
	badDeflate := bytes.Clone(goodGz)
	for i := 10; i < len(badDeflate)-8; i++ {
		badDeflate[i] = 0xff
	}
	return []corruptCase{
		{"empty file", true, nil, "shorter than an IDX header"},
		{"one byte", true, []byte{0}, "shorter than an IDX header"},
		{"truncated header", true, good[:9], "truncated IDX header"},
		{"labels as images", true, idxBytes(MagicIDXLabels, []uint32{3}, []byte{1, 2, 3}), "bad magic 0x00000801 (IDX labels), want 0x00000803 (IDX images)"},
		{"images as labels", false, good, "bad magic 0x00000803 (IDX images), want 0x00000801 (IDX labels)"},
		{"text file", true, []byte("this is not an IDX file at all"), "not an IDX file"},
		{"float elements", true, idxBytes(0x00000d03, []uint32{1, 1, 1}, make([]byte, 4)), "bad magic"},
		{"truncated payload", true, good[:len(good)-1], "need 24 bytes of data, the file holds 23"},
		{"trailing data", true, append(bytes.Clone(good), 0), "need 24 bytes of data, the file holds 25"},
		{"zero rows", true, idxBytes(MagicIDXImages, []uint32{1, 0, 3}, nil), "dimension 1 is zero"},
		{"absurd count", true, idxBytes(MagicIDXImages, []uint32{0xffffffff, 28, 28}, nil), "more than the limit"},
		{"absurd side", true, idxBytes(MagicIDXImages, []uint32{1, 1 << 20, 1}, nil), "more than the limit"},
		{"absurd total", true, idxBytes(MagicIDXImages, []uint32{1 << 24, 1 << 12, 1 << 12}, nil), "more than the limit"},
		{"absurd labels", false, idxBytes(MagicIDXLabels, []uint32{0x80000000}, nil), "more than the limit"},
		{"gzip truncated", true, goodGz[:len(goodGz)/2], "truncated"},
		{"gzip trailer cut", true, goodGz[:len(goodGz)-3], "truncated"},
		{"gzip bad checksum", true, badCRC, "checksum"},
		{"gzip bad deflate", true, badDeflate, "gzip stream"},
		{"gzip bad header", true, []byte{0x1f, 0x8b, 0, 0, 0}, "gzip"},
		{"gzip payload short", true, gzipBytes(t, good[:len(good)-5]), "truncated data (header dimensions [4 2 3] need 24 bytes, read 19)"},
		{"gzip payload long", true, gzipBytes(t, append(bytes.Clone(good), 1, 2)), "more data than the header dimensions [4 2 3] declare"},
	}
}

func TestReadIDXCorrupt(t *testing.T) {
	dir := t.TempDir()
	for i, c := range corruptCases(t) {
		p := writeFile(t, filepath.Join(dir, "f"+string(rune('a'+i))), c.file)
		var err error
		if c.images {
			_, _, _, _, err = ReadIDXImages(p)
		} else {
			_, err = ReadIDXLabels(p)
		}
		if !errors.Is(err, ErrCorrupt) {
			t.Errorf("%s: error %v, want ErrCorrupt", c.name, err)
			continue
		}
		if msg := err.Error(); !strings.Contains(msg, p) || !strings.Contains(msg, c.want) || !strings.HasPrefix(msg, "data: ") {
			t.Errorf("%s: error %q should start with \"data: \" and contain the path and %q", c.name, msg, c.want)
		}
	}
}

// TestReadIDXLyingHeaderAllocatesLittle: a small gzip file whose header claims 2^30 bytes
// must fail without allocating anything like that.
func TestReadIDXLyingHeaderAllocatesLittle(t *testing.T) {
	lie := idxBytes(MagicIDXImages, []uint32{1 << 12, 1 << 9, 1 << 9}, seq(1000)) // claims 1 GiB
	p := writeFile(t, filepath.Join(t.TempDir(), "lie.gz"), gzipBytes(t, lie))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, _, _, _, err := ReadIDXImages(p)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), "truncated") {
		t.Fatalf("error %v, want a truncation ErrCorrupt", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Fatalf("allocated %d bytes reading a 1000-byte payload", got)
	}
	// A gzip trailer forged to agree with the header is not believed either: 1 GiB from a
	// file of a few kilobytes is beyond maxTrustedGzipRatio.
	gz := gzipBytes(t, lie)
	binary.LittleEndian.PutUint32(gz[len(gz)-4:], 16+1<<30)
	writeFile(t, p, gz)
	runtime.ReadMemStats(&before)
	_, _, _, _, err = ReadIDXImages(p)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, ErrCorrupt) {
		t.Fatalf("forged trailer: error %v, want ErrCorrupt", err)
	}
	if got := after.TotalAlloc - before.TotalAlloc; got > 1<<20 {
		t.Fatalf("forged trailer: allocated %d bytes reading a 1000-byte payload", got)
	}
}

// TestReadIDXGzipAllocatesOnce: a gzip file whose trailer agrees with its header is decoded
// straight into a buffer of the payload's size, not grown through copies (which allocates
// about twice the payload).
func TestReadIDXGzipAllocatesOnce(t *testing.T) {
	const n, side = 4000, 28
	pix := make([]byte, n*side*side)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range pix {
		pix[i] = byte(rng.IntN(64)) // compresses about 1.3×, like real images
	}
	p := writeFile(t, filepath.Join(t.TempDir(), "img.gz"), gzipBytes(t, idxBytes(MagicIDXImages, []uint32{n, side, side}, pix)))
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	_, _, _, got, err := ReadIDXImages(p)
	runtime.ReadMemStats(&after)
	if err != nil || !bytes.Equal(got, pix) {
		t.Fatalf("read back: %v", err)
	}
	alloc := after.TotalAlloc - before.TotalAlloc
	t.Logf("read %d payload bytes with %d bytes allocated", len(pix), alloc)
	if alloc > uint64(len(pix))+uint64(len(pix))/4 {
		t.Fatalf("allocated %d bytes for a payload of %d", alloc, len(pix))
	}
}

func TestReadIDXMissingFile(t *testing.T) {
	p := filepath.Join(t.TempDir(), "nope.gz")
	_, _, _, _, err := ReadIDXImages(p)
	if !errors.Is(err, fs.ErrNotExist) || errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), p) {
		t.Fatalf("error %v, want a not-exist error naming the file", err)
	}
}

// FuzzReadIDX feeds arbitrary bytes, raw or behind gzip detection, to the parser. It must
// never panic; it either returns a payload matching the dimensions, or an ErrCorrupt error
// (an in-memory reader has no I/O errors).
func FuzzReadIDX(f *testing.F) {
	f.Add(idxBytes(MagicIDXImages, []uint32{2, 2, 2}, seq(8)), true)
	f.Add(idxBytes(MagicIDXLabels, []uint32{3}, []byte{1, 2, 9}), false)
	f.Add(gzipBytes(f, idxBytes(MagicIDXImages, []uint32{1, 3, 3}, seq(9))), true)
	f.Add(gzipBytes(f, idxBytes(MagicIDXLabels, []uint32{2}, []byte{0, 1})), false)
	for _, c := range corruptCases(f) {
		f.Add(c.file, c.images)
	}
	f.Fuzz(func(t *testing.T, in []byte, images bool) {
		magic := uint32(MagicIDXLabels)
		if images {
			magic = MagicIDXImages
		}
		// Once with the size known (a regular file), once without (a pipe).
		for _, size := range []int64{int64(len(in)), -1} {
			isize := int64(-1) // as readIDXFile reads it from a regular file
			if size >= 4 {
				isize = int64(binary.LittleEndian.Uint32(in[size-4:]))
			}
			dims, payload, err := readIDX(bytes.NewReader(in), size, isize, magic, 0)
			if err != nil {
				if !errors.Is(err, ErrCorrupt) {
					t.Fatalf("size %d: error %v does not wrap ErrCorrupt", size, err)
				}
				continue
			}
			want := 1
			for _, d := range dims {
				want *= d
			}
			if len(dims) != int(magic&0xff) || len(payload) != want {
				t.Fatalf("size %d: dims %v with %d payload bytes", size, dims, len(payload))
			}
		}
	})
}
