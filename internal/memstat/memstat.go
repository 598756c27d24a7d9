package memstat

import (
	"bytes"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime/metrics"
	"sync"
)

// Snapshot is one reading of the memory figures, in bytes unless the name says otherwise.
// A zero field means the figure was not available.
type Snapshot struct {
	HeapInUse   uint64 // Go heap objects in use (runtime/metrics "/memory/classes/heap/objects:bytes")
	GoTotal     uint64 // all memory mapped by the Go runtime ("/memory/classes/total:bytes")
	RSS         uint64 // resident set size (/proc/self/statm, resident pages * page size)
	Available   uint64 // system MemAvailable (/proc/meminfo)
	Total       uint64 // system MemTotal (/proc/meminfo)
	SwapInPages uint64 // cumulative pages swapped in since boot (pswpin in /proc/vmstat)
	// SwapOutPages is the cumulative count of pages swapped out since boot (pswpout). A rise
	// between two steps means the machine is swapping, which explains a sudden slowdown.
	SwapOutPages uint64
}

// Names of the runtime/metrics samples, in the order of Reader.samples.
const (
	heapObjectsMetric = "/memory/classes/heap/objects:bytes"
	totalMetric       = "/memory/classes/total:bytes"
)

// initialBufSize fits /proc/meminfo (~1.5 KiB) and /proc/vmstat (~4-8 KiB on current kernels);
// a buffer that turns out too small is doubled once, on the first Read.
const initialBufSize = 8 << 10

// Reader takes Snapshots. Create one with NewReader and reuse it.
type Reader struct {
	mu       sync.Mutex
	samples  []metrics.Sample
	statm    procFile
	meminfo  procFile
	vmstat   procFile
	pageSize uint64
	closed   bool
}

// NewReader returns a Reader of the current process and host. The /proc files are opened on
// the first Read.
func NewReader() *Reader {
	return newReaderAt("/proc")
}

// NewReaderAt returns a Reader of the /proc files under root instead of /proc, so tests (of
// this package and of its users) can substitute their own.
func NewReaderAt(root string) *Reader { return newReaderAt(root) }

func newReaderAt(root string) *Reader {
	return &Reader{
		samples: []metrics.Sample{
			{Name: heapObjectsMetric},
			{Name: totalMetric},
		},
		statm:    procFile{path: filepath.Join(root, "self", "statm")},
		meminfo:  procFile{path: filepath.Join(root, "meminfo")},
		vmstat:   procFile{path: filepath.Join(root, "vmstat")},
		pageSize: uint64(os.Getpagesize()),
	}
}

// Read returns the current figures.
func (r *Reader) Read() Snapshot {
	r.mu.Lock()
	defer r.mu.Unlock()

	var s Snapshot
	metrics.Read(r.samples)
	s.HeapInUse = sampleUint64(r.samples[0])
	s.GoTotal = sampleUint64(r.samples[1])
	if r.closed {
		return s
	}
	if b := r.statm.read(); b != nil {
		// statm is "size resident shared text lib data dt", in pages. It is preferred to
		// /proc/self/status because it is a fixed, short format: one field, no key search.
		if pages, ok := nthField(b, 1); ok {
			s.RSS = pages * r.pageSize
		}
	}
	if b := r.meminfo.read(); b != nil {
		if kb, ok := lookup(b, "MemAvailable:"); ok {
			s.Available = kb << 10 // meminfo reports kB, meaning KiB
		}
		if kb, ok := lookup(b, "MemTotal:"); ok {
			s.Total = kb << 10
		}
	}
	if b := r.vmstat.read(); b != nil {
		s.SwapInPages, _ = lookup(b, "pswpin")
		s.SwapOutPages, _ = lookup(b, "pswpout")
	}
	return s
}

// Close releases the open /proc files. It is safe to call more than once.
func (r *Reader) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	return errors.Join(r.statm.close(), r.meminfo.close(), r.vmstat.close())
}

func sampleUint64(s metrics.Sample) uint64 {
	// A name the running Go version does not know reads as KindBad: report it as unknown.
	if s.Value.Kind() != metrics.KindUint64 {
		return 0
	}
	return s.Value.Uint64()
}

// procFile is a /proc file kept open between reads. Reading a seq_file-backed /proc file
// from offset 0 regenerates its contents, so pread at 0 gives fresh figures without the
// open/close (and the allocations of os.Open) on every step.
type procFile struct {
	path   string
	f      *os.File
	failed bool // opening failed once; the file will not appear later, so stop trying
	buf    []byte
}

// read returns the file's current contents, valid until the next read, or nil.
func (p *procFile) read() []byte {
	if p.f == nil {
		if p.failed {
			return nil
		}
		f, err := os.Open(p.path)
		if err != nil {
			p.failed = true
			return nil
		}
		p.f = f
		p.buf = make([]byte, initialBufSize)
	}
	for {
		n, err := readFull(p.f, p.buf)
		if err != nil {
			return nil
		}
		if n < len(p.buf) {
			return p.buf[:n]
		}
		// Filled the buffer: the contents may be cut short. Grow and read again from 0, so
		// one snapshot of the file is parsed, never the halves of two.
		p.buf = make([]byte, 2*len(p.buf))
	}
}

// readFull reads from offset 0 until buf is full or the file ends.
func readFull(f *os.File, buf []byte) (int, error) {
	total := 0
	for total < len(buf) {
		n, err := f.ReadAt(buf[total:], int64(total))
		total += n
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
		if n == 0 {
			return total, nil
		}
	}
	return total, nil
}

func (p *procFile) close() error {
	if p.f == nil {
		return nil
	}
	err := p.f.Close()
	p.f = nil
	return err
}

// lookup finds the line starting with key followed by blanks and returns the number after
// them. It is used instead of fmt.Sscanf, which allocates, on the per-step path.
func lookup(b []byte, key string) (uint64, bool) {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		if len(line) > len(key) && string(line[:len(key)]) == key && isBlank(line[len(key)]) {
			return parseUint(line[len(key):])
		}
	}
	return 0, false
}

// nthField returns the n-th (0-based) blank-separated number of the first line of b.
func nthField(b []byte, n int) (uint64, bool) {
	if i := bytes.IndexByte(b, '\n'); i >= 0 {
		b = b[:i]
	}
	for field := 0; ; field++ {
		for len(b) > 0 && isBlank(b[0]) {
			b = b[1:]
		}
		if len(b) == 0 {
			return 0, false
		}
		end := 0
		for end < len(b) && !isBlank(b[end]) {
			end++
		}
		if field == n {
			return parseUint(b[:end])
		}
		b = b[end:]
	}
}

// parseUint parses the decimal number after optional leading blanks, stopping at the first
// byte that is not a digit (meminfo's " kB" suffix).
func parseUint(b []byte) (uint64, bool) {
	for len(b) > 0 && isBlank(b[0]) {
		b = b[1:]
	}
	var v uint64
	digits := 0
	for ; digits < len(b) && b[digits] >= '0' && b[digits] <= '9'; digits++ {
		d := uint64(b[digits] - '0')
		if v > (math.MaxUint64-d)/10 {
			return 0, false // overflow: not a figure we can trust
		}
		v = v*10 + d
	}
	return v, digits > 0
}

func isBlank(c byte) bool { return c == ' ' || c == '\t' }
