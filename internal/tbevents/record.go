package tbevents

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
)

const (
	// headerLen is the record header: the uint64 data length and the masked CRC of those 8 bytes.
	headerLen = 8 + 4
	// footerLen is the masked CRC of the data.
	footerLen = 4
	// crcMaskDelta is the constant of LevelDB's CRC mask (util/crc32c.h), used by TFRecord.
	crcMaskDelta = 0xa282ead8
	// maxRecordLen bounds what a reader allocates for one record. The length is checked against
	// its CRC first, so only a length that was written as such can reach this; event files hold
	// records of bytes to kilobytes (images and graphs: megabytes).
	maxRecordLen = 1 << 30
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// ErrCorrupt marks a record whose length or data does not match its checksum.
var ErrCorrupt = errors.New("tbevents: corrupt record")

// ErrTruncated marks a file that ends inside a record: what a writer still running, or one
// that was killed, leaves behind.
var ErrTruncated = errors.New("tbevents: truncated record")

// MaskedCRC returns the TFRecord checksum of b: CRC-32C (Castagnoli), rotated right by 15
// bits, plus crcMaskDelta.
func MaskedCRC(b []byte) uint32 {
	return mask(crc32.Checksum(b, castagnoli))
}

func mask(crc uint32) uint32 { return (crc>>15 | crc<<17) + crcMaskDelta }

// AppendRecord appends data framed as one TFRecord to dst and returns the extended slice.
func AppendRecord(dst, data []byte) []byte {
	// The length is checksummed where it lands in dst: a local array passed to crc32 would
	// escape to the heap (crc32 calls its implementation through a function value).
	start := len(dst)
	dst = binary.LittleEndian.AppendUint64(dst, uint64(len(data)))
	dst = binary.LittleEndian.AppendUint32(dst, MaskedCRC(dst[start:]))
	dst = append(dst, data...)
	return binary.LittleEndian.AppendUint32(dst, MaskedCRC(data))
}

// RecordReader reads TFRecords one at a time.
type RecordReader struct {
	r   *bufio.Reader
	off int64  // offset of the next record, for errors
	buf []byte // the last record's data, reused
}

// NewRecordReader returns a reader of the records in r.
func NewRecordReader(r io.Reader) *RecordReader {
	return &RecordReader{r: bufio.NewReader(r)}
}

// Next returns the next record's data, valid until the following call. At the end of the
// input it returns io.EOF; a record cut short returns an error wrapping ErrTruncated, and a
// checksum mismatch one wrapping ErrCorrupt, both naming the record's offset.
func (rr *RecordReader) Next() ([]byte, error) {
	var h [headerLen]byte
	if n, err := io.ReadFull(rr.r, h[:]); err != nil {
		if n == 0 && err == io.EOF {
			return nil, io.EOF
		}
		return nil, rr.fail(err)
	}
	if got, want := MaskedCRC(h[:8]), binary.LittleEndian.Uint32(h[8:]); got != want {
		return nil, fmt.Errorf("record at offset %d: length checksum %#08x, want %#08x: %w", rr.off, got, want, ErrCorrupt)
	}
	n := binary.LittleEndian.Uint64(h[:8])
	if n > maxRecordLen {
		return nil, fmt.Errorf("record at offset %d: length %d exceeds %d: %w", rr.off, n, maxRecordLen, ErrCorrupt)
	}
	if uint64(cap(rr.buf)) < n+footerLen {
		rr.buf = make([]byte, n+footerLen)
	}
	buf := rr.buf[:n+footerLen]
	if _, err := io.ReadFull(rr.r, buf); err != nil {
		return nil, rr.fail(err)
	}
	data := buf[:n]
	if got, want := MaskedCRC(data), binary.LittleEndian.Uint32(buf[n:]); got != want {
		return nil, fmt.Errorf("record at offset %d: data checksum %#08x, want %#08x: %w", rr.off, got, want, ErrCorrupt)
	}
	rr.off += headerLen + int64(n) + footerLen
	return data, nil
}

func (rr *RecordReader) fail(err error) error {
	if err == io.EOF || err == io.ErrUnexpectedEOF {
		return fmt.Errorf("record at offset %d: %w", rr.off, ErrTruncated)
	}
	return fmt.Errorf("record at offset %d: %w", rr.off, err)
}
