package memstat

import (
	"bytes"
	"cmp"
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
	HeapInUse uint64 // Go heap objects in use (runtime/metrics "/memory/classes/heap/objects:bytes")
	GoTotal   uint64 // all memory mapped by the Go runtime ("/memory/classes/total:bytes")
	RSS       uint64 // resident set size (/proc/self/statm, resident pages * page size)
	// Available is the memory this process can still have: the smaller of the machine's
	// MemAvailable and its memory cgroup's limit less the cgroup's working set. LimitedBy
	// says which. With a cgroup limit it can be 0 while LimitedBy is LimitCgroup: none left.
	Available uint64
	// Total is the smaller of the machine's MemTotal and the cgroup's limit.
	Total     uint64
	LimitedBy Limit
	// HostAvailable and HostTotal are the machine's MemAvailable and MemTotal (/proc/meminfo).
	HostAvailable, HostTotal uint64
	// The memory cgroup of this process (zero: none, no limit, or not readable). CgroupLimit
	// is the limit that leaves the least available memory among the process's cgroup and
	// its ancestors (v2 memory.max; v1 memory.limit_in_bytes and hierarchical_memory_limit),
	// CgroupDir that cgroup's directory, CgroupUsage its memory.current
	// (memory.usage_in_bytes) and CgroupWorkingSet the usage less its inactive file pages,
	// which the kernel reclaims before it OOM-kills (the kubelet's and cAdvisor's working
	// set): Available in the cgroup is CgroupLimit - CgroupWorkingSet.
	CgroupLimit, CgroupUsage, CgroupWorkingSet uint64
	CgroupDir                                  string
	// CgroupOOMKills is the number of processes the OOM killer has killed under the cgroup's
	// limit (oom_kill in memory.events, v1 memory.oom_control), cumulative.
	CgroupOOMKills uint64
	SwapInPages    uint64 // cumulative pages swapped in since boot (pswpin in /proc/vmstat)
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
	// procRoot and fsRoot locate the memory cgroup on the first Read ("" fsRoot: none).
	procRoot, fsRoot string
	cgFound          bool
	cg               cgroup
}

// NewReader returns a Reader of the current process and host. The /proc files are opened on
// the first Read.
func NewReader() *Reader {
	return newReaderAtRoots("/proc", "/")
}

// NewReaderAt returns a Reader of the /proc files under root instead of /proc, so tests (of
// this package and of its users) can substitute their own. It reads no cgroup.
func NewReaderAt(root string) *Reader { return newReaderAt(root) }

// NewReaderAtRoots returns a Reader of the /proc files under proc, which also reads the
// memory cgroup that proc's self/cgroup and self/mountinfo name, with the mount points
// (/sys/fs/cgroup...) looked up under root instead of /.
func NewReaderAtRoots(proc, root string) *Reader { return newReaderAtRoots(proc, root) }

func newReaderAt(root string) *Reader { return newReaderAtRoots(root, "") }

func newReaderAtRoots(root, fsRoot string) *Reader {
	return &Reader{
		procRoot: root,
		fsRoot:   fsRoot,
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
			s.HostAvailable = kb << 10 // meminfo reports kB, meaning KiB
		}
		if kb, ok := lookup(b, "MemTotal:"); ok {
			s.HostTotal = kb << 10
		}
	}
	s.Available, s.Total = s.HostAvailable, s.HostTotal
	if s.HostAvailable > 0 {
		s.LimitedBy = LimitHost
	}
	if !r.cgFound {
		r.cg, r.cgFound = findCgroup(r.procRoot, r.fsRoot), true
	}
	r.cg.read(&s)
	if s.CgroupLimit > 0 {
		if avail := s.CgroupLimit - min(s.CgroupWorkingSet, s.CgroupLimit); s.LimitedBy == LimitUnknown || avail < s.HostAvailable {
			s.Available, s.LimitedBy = avail, LimitCgroup
		}
		if s.Total == 0 || s.CgroupLimit < s.Total {
			s.Total = s.CgroupLimit
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
	return errors.Join(r.statm.close(), r.meminfo.close(), r.vmstat.close(), r.cg.close())
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
	size   int // the buffer's first size (0: initialBufSize)
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
		p.buf = make([]byte, cmp.Or(p.size, initialBufSize))
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
