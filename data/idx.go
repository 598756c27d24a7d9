package data

import (
	"bufio"
	"compress/flate"
	"compress/gzip"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
)

// ErrCorrupt is wrapped by every error that comes from the content of a dataset file rather
// than from reaching it: bad magic, truncated data, a gzip error, dimensions that disagree with
// the payload, counts that disagree between images and labels, labels out of range.
var ErrCorrupt = errors.New("corrupt IDX file")

// IDX format (LeCun's MNIST page): a 4-byte big-endian magic 0x0000TTDD, where TT is the
// element type and DD the number of dimensions, then DD big-endian uint32 sizes, then the
// elements in row-major order.
const (
	MagicIDXImages = 0x00000803 // unsigned bytes, 3 dimensions: count, rows, cols
	MagicIDXLabels = 0x00000801 // unsigned bytes, 1 dimension: count
)

// Sanity limits on header dimensions. Every IDX image set in use is far inside them; a header
// beyond them is taken as corrupt rather than obeyed.
const (
	MaxIDXSamples = 1 << 24   // samples per file (Fashion-MNIST has 60000, EMNIST ~800000)
	MaxIDXSide    = 1 << 12   // rows or columns of one image
	MaxIDXBytes   = 1<<31 - 1 // payload bytes of one file; fits an int on 32-bit platforms too
)

// maxTrustedGzipRatio bounds how far a gzip trailer is believed. A gzip stream ends with
// ISIZE, its decompressed size mod 2^32 (RFC 1952); when it agrees with the IDX header and
// the decompressed size is at most this many times the compressed file, the payload buffer
// is allocated at its final size at once, instead of grown as data arrives (which allocates
// about twice the payload on the way). IDX image files compress 1.8× (Fashion-MNIST) to
// about 5× (MNIST); a file that lies in both header and trailer costs at most this factor
// times its own size before the lie is found.
const maxTrustedGzipRatio = 8

// gzipMagic starts every gzip stream (RFC 1952). A raw IDX file starts with two zero bytes, so
// the two cannot be confused.
var gzipMagic = [2]byte{0x1f, 0x8b}

// ReadIDXImages reads an IDX file of uint8 images (magic 0x00000803), gzip-compressed or raw,
// and returns the image count, the image size and the pixels, n*rows*cols bytes row-major.
func ReadIDXImages(path string) (n, rows, cols int, pix []uint8, err error) {
	dims, pix, err := readIDXFile(path, MagicIDXImages, 0)
	if err != nil {
		return 0, 0, 0, nil, fmt.Errorf("data: %w", err)
	}
	return dims[0], dims[1], dims[2], pix, nil
}

// ReadIDXLabels reads an IDX file of uint8 labels (magic 0x00000801), gzip-compressed or raw.
// It does not check the label values; Load does.
func ReadIDXLabels(path string) (labels []uint8, err error) {
	_, labels, err = readIDXFile(path, MagicIDXLabels, 0)
	if err != nil {
		return nil, fmt.Errorf("data: %w", err)
	}
	return labels, nil
}

// readIDXFile opens path and parses it, keeping the first keep samples (0 = all; see
// readIDX). Errors start with the path; an open failure is the *fs.PathError itself, so
// errors.Is(err, fs.ErrNotExist) works.
func readIDXFile(path string, magic uint32, keep int) (dims []int, payload []byte, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	size, isize := int64(-1), int64(-1)
	if st, err := f.Stat(); err == nil && st.Mode().IsRegular() {
		size = st.Size()
		var tail [4]byte
		if size >= 4 {
			if _, err := f.ReadAt(tail[:], size-4); err == nil {
				isize = int64(binary.LittleEndian.Uint32(tail[:]))
			}
		}
	}
	dims, payload, err = readIDX(f, size, isize, magic, keep)
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", path, err)
	}
	return dims, payload, nil
}

// readIDX parses one IDX stream of unsigned bytes with the given magic, gzip-compressed or
// raw. size is the length of r in bytes if known (a regular file), or -1; it lets a raw file's
// payload be checked against its header before anything is allocated. isize is the last
// four bytes of a regular file as a little-endian number, or -1: a gzip stream's ISIZE (see
// maxTrustedGzipRatio).
//
// keep > 0 keeps only the first keep samples (entries of the first dimension): the rest of the
// stream is decoded and checked as before, but into a small scratch buffer, so a subset never
// costs the full payload's memory, not even for a moment. dims still describe the whole file.
func readIDX(r io.Reader, size, isize int64, magic uint32, keep int) (dims []int, payload []byte, err error) {
	br := bufio.NewReaderSize(r, 64<<10)
	head, err := br.Peek(2)
	if err != nil {
		if err == io.EOF {
			return nil, nil, fmt.Errorf("%w: truncated: file is shorter than an IDX header", ErrCorrupt)
		}
		return nil, nil, err
	}
	var src io.Reader = br
	compressed := int64(-1)
	if head[0] == gzipMagic[0] && head[1] == gzipMagic[1] {
		compressed = size
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, nil, classify(err, "gzip header")
		}
		defer zr.Close()
		src, size = zr, -1 // the decompressed size is unknown until the end
	}

	dims, hlen, want, err := readHeader(src, magic)
	if err != nil {
		return nil, nil, err
	}
	if size >= 0 && size-int64(hlen) != int64(want) {
		return nil, nil, fmt.Errorf("%w: header dimensions %v need %d bytes of data, the file holds %d", ErrCorrupt, dims, want, size-int64(hlen))
	}
	kept := want
	if keep > 0 && keep < dims[0] {
		kept = keep * (want / dims[0])
	}
	// A gzip trailer that agrees with the header (and a believable ratio) sizes the buffer.
	trailerAgrees := compressed > 0 && isize >= 0 && uint32(hlen+want) == uint32(isize) &&
		int64(want) <= maxTrustedGzipRatio*compressed
	var got int
	if size >= 0 || trailerAgrees {
		// The header agrees with the file's size or the gzip trailer, so it can size the
		// buffer; a short stream is still an error below.
		payload = make([]byte, kept)
		got, err = io.ReadFull(src, payload)
	} else {
		payload, err = readPayload(src, kept)
		got = len(payload)
	}
	if err == nil && kept < want {
		var skipped int64
		skipped, err = io.CopyN(io.Discard, src, int64(want-kept))
		got += int(skipped)
	}
	if err != nil {
		return nil, nil, classify(err, fmt.Sprintf("data (header dimensions %v need %d bytes, read %d)", dims, want, got))
	}
	// Read on to the end: a gzip stream verifies its checksum only there, and anything after
	// the declared payload means the header is wrong.
	var extra [1]byte
	switch k, err := io.ReadFull(src, extra[:]); {
	case k > 0:
		return nil, nil, fmt.Errorf("%w: more data than the header dimensions %v declare (%d bytes)", ErrCorrupt, dims, want)
	case err != io.EOF:
		return nil, nil, classify(err, "end of data")
	}
	return dims, payload, nil
}

// readHeader reads and checks an IDX header with the given magic from src: the dimensions,
// the header's length and the payload's, within the sanity limits.
func readHeader(src io.Reader, magic uint32) (dims []int, hlen, want int, err error) {
	// The magic is checked before the dimensions are read, so a file of the wrong kind is
	// reported as such rather than as a truncated header.
	ndims := int(magic & 0xff)
	var hdr [4 + 4*3]byte
	hlen = 4 + 4*ndims
	if _, err := io.ReadFull(src, hdr[:4]); err != nil {
		return nil, 0, 0, classify(err, "IDX header")
	}
	if got := binary.BigEndian.Uint32(hdr[:4]); got != magic {
		return nil, 0, 0, fmt.Errorf("%w: bad magic %#08x (%s), want %#08x (%s)", ErrCorrupt, got, describeMagic(got), magic, describeMagic(magic))
	}
	if _, err := io.ReadFull(src, hdr[4:hlen]); err != nil {
		return nil, 0, 0, classify(err, "IDX header")
	}
	dims = make([]int, ndims)
	total := uint64(1)
	for i := range dims {
		d := binary.BigEndian.Uint32(hdr[4+4*i:])
		limit := uint32(MaxIDXSide)
		if i == 0 {
			limit = MaxIDXSamples
		} else if d == 0 {
			return nil, 0, 0, fmt.Errorf("%w: dimension %d is zero", ErrCorrupt, i)
		}
		if d > limit {
			return nil, 0, 0, fmt.Errorf("%w: dimension %d is %d, more than the limit %d", ErrCorrupt, i, d, limit)
		}
		dims[i] = int(d)
		total *= uint64(d) // at most 2^24 * 2^12 * 2^12: no overflow
	}
	if total > MaxIDXBytes {
		return nil, 0, 0, fmt.Errorf("%w: header declares %d bytes of data, more than the limit %d", ErrCorrupt, total, MaxIDXBytes)
	}
	return dims, hlen, int(total), nil
}

// readPayload reads exactly n bytes from a stream of unknown length. It grows its buffer as
// data arrives instead of allocating n bytes up front, so a header that lies about a gzip
// stream's size costs at most about twice the data actually present. The buffer ends with
// capacity exactly n.
func readPayload(r io.Reader, n int) ([]byte, error) {
	const firstChunk = 64 << 10
	buf := make([]byte, 0, min(n, firstChunk))
	for len(buf) < n {
		if len(buf) == cap(buf) {
			grown := make([]byte, len(buf), min(n, 2*cap(buf)))
			copy(grown, buf)
			buf = grown
		}
		k, err := r.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+k]
		if err == io.EOF {
			if len(buf) < n {
				return buf, io.ErrUnexpectedEOF
			}
			break
		}
		if err != nil {
			return buf, err
		}
	}
	return buf, nil
}

// classify wraps a read error, marking as ErrCorrupt the errors that mean the content is bad
// (early end, gzip or deflate damage) and leaving I/O errors as they are.
func classify(err error, what string) error {
	var corrupt flate.CorruptInputError
	switch {
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF):
		return fmt.Errorf("%w: truncated %s: %w", ErrCorrupt, what, io.ErrUnexpectedEOF)
	case errors.Is(err, gzip.ErrHeader), errors.Is(err, gzip.ErrChecksum), errors.As(err, &corrupt):
		return fmt.Errorf("%w: gzip stream, reading %s: %w", ErrCorrupt, what, err)
	}
	return fmt.Errorf("reading %s: %w", what, err)
}

// describeMagic names the IDX magics a user is likely to hand us by mistake.
func describeMagic(m uint32) string {
	switch m {
	case MagicIDXImages:
		return "IDX images"
	case MagicIDXLabels:
		return "IDX labels"
	}
	if m>>16 != 0 {
		return "not an IDX file"
	}
	return fmt.Sprintf("IDX type %#02x with %d dimensions", m>>8&0xff, m&0xff)
}
