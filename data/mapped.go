package data

import (
	"bufio"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Images are mapped, not read: a raw IDX file is mapped read-only as it is, and a
// gzip-compressed one is decompressed once into a cache directory and that copy is mapped.
// The pixels are then page cache, not heap: the ranks of a job on one host share one copy
// (where each would otherwise hold its own), the kernel reads a page in only when a batch
// first touches it and may drop clean pages under memory pressure, and the Go collector
// neither scans nor counts them. A mapping lives as long as the process.
//
// The cached copy is named by a hash of the source file's absolute path, size and
// modification time, so a changed source gets a new copy; it is written to a temporary file
// and renamed into place, so concurrent ranks and crashes never leave a partial copy under
// that name, and its header and size are checked again each time it is mapped.

// CacheNone is Config.Cache's value that reads images into memory instead of mapping them.
const CacheNone = "none"

// errNoMap marks a failure of the mapping machinery itself (no cache directory, a file system
// without mmap): loadSplit falls back to reading the file into memory.
var errNoMap = errors.New("cannot map")

// cacheDir is where decompressed copies go: cfg.Cache, or the user's cache directory.
func cacheDir(cfg Config) (string, error) {
	if cfg.Cache != "" {
		return cfg.Cache, nil
	}
	d, err := os.UserCacheDir()
	if err != nil {
		return "", fmt.Errorf("%w: no cache directory (%v); set data.cache", errNoMap, err)
	}
	return filepath.Join(d, "qvd", "datasets"), nil
}

// mapImages returns the IDX image file at path mapped (its pixels, after the header), and
// the file that is mapped (path itself, or its decompressed copy).
func mapImages(cfg Config, path string) (dims []int, pix []byte, mapped string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, "", err
	}
	defer f.Close()
	var head [2]byte
	if _, err := io.ReadFull(f, head[:]); err != nil {
		return nil, nil, "", fmt.Errorf("read %s: %w", path, classify(err, "IDX header"))
	}
	if head != gzipMagic {
		dims, pix, err := mapRaw(path)
		return dims, pix, path, err
	}
	dir, err := cacheDir(cfg)
	if err != nil {
		return nil, nil, "", err
	}
	st, err := f.Stat()
	if err != nil {
		return nil, nil, "", err
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, nil, "", err
	}
	key := sha256.Sum256([]byte(abs + "\x00" + strconv.FormatInt(st.Size(), 10) + "\x00" + strconv.FormatInt(st.ModTime().UnixNano(), 10)))
	name := strings.TrimSuffix(filepath.Base(path), ".gz") + "-" + hex.EncodeToString(key[:10])
	cached := filepath.Join(dir, name)
	if dims, pix, err := mapRaw(cached); err == nil {
		return dims, pix, cached, nil
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, nil, "", err
	}
	if err := decompressTo(f, dir, cached); err != nil {
		return nil, nil, "", fmt.Errorf("read %s: %w", path, err)
	}
	dims, pix, err = mapRaw(cached)
	return dims, pix, cached, err
}

// decompressTo writes the IDX image stream in r (gzip) to dst, checked as readIDX checks it:
// the header, the payload's length, the gzip checksum, nothing after the end.
func decompressTo(r io.Reader, dir, dst string) error {
	zr, err := gzip.NewReader(bufio.NewReaderSize(r, 64<<10))
	if err != nil {
		return classify(err, "gzip header")
	}
	defer zr.Close()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("%w: %v", errNoMap, err)
	}
	tmp, err := os.CreateTemp(dir, filepath.Base(dst)+".tmp*")
	if err != nil {
		return fmt.Errorf("%w: %v", errNoMap, err)
	}
	ok := false
	defer func() {
		if !ok {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	// The header goes through as read; readHeader checks it on the way.
	hr := io.TeeReader(zr, tmp)
	_, _, want, err := readHeader(hr, MagicIDXImages)
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(tmp, 64<<10)
	n, err := io.CopyN(w, zr, int64(want))
	if err != nil {
		return classify(err, fmt.Sprintf("data (%d bytes, read %d)", want, n))
	}
	var extra [1]byte
	switch k, err := io.ReadFull(zr, extra[:]); {
	case k > 0:
		return fmt.Errorf("%w: more data than the header dimensions declare (%d bytes)", ErrCorrupt, want)
	case err != io.EOF:
		return classify(err, "end of data")
	}
	if err := w.Flush(); err != nil {
		return fmt.Errorf("%w: writing %s: %v", errNoMap, tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("%w: writing %s: %v", errNoMap, tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return fmt.Errorf("%w: %v", errNoMap, err)
	}
	ok = true
	return nil
}

// mapRaw maps a raw IDX image file read-only and returns its dimensions and pixels, after
// checking its header and that its size is what the header declares.
func mapRaw(path string) ([]int, []byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, nil, err
	}
	dims, hlen, want, err := readHeader(f, MagicIDXImages)
	if err != nil {
		return nil, nil, fmt.Errorf("read %s: %w", path, err)
	}
	if st.Size()-int64(hlen) != int64(want) {
		return nil, nil, fmt.Errorf("read %s: %w: header dimensions %v need %d bytes of data, the file holds %d", path, ErrCorrupt, dims, want, st.Size()-int64(hlen))
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: mapping %s: %v", errNoMap, path, err)
	}
	// Batches read samples in a random order: reading ahead would only fill memory with
	// pages no batch has asked for yet.
	_ = unix.Madvise(m, unix.MADV_RANDOM)
	return dims, m[hlen:], nil
}
