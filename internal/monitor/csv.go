package monitor

import (
	"bufio"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/qvd/qvd/internal/tbevents"
)

// flushInterval: a write at least this long after the last flush flushes (see tbevents).
const flushInterval = time.Second

// ErrClosed is returned by writes after Close.
var ErrClosed = errors.New("monitor: closed")

// CSVWriter writes each scalar to its own file in dir, as DeepSpeed's csv_monitor does
// (deepspeed/monitor/csv_monitor.py): the file is the tag with '/' and ' ' replaced by '_',
// plus ".csv"; its header is "step," and the tag's last '/'-separated part; each row is
// "step,value". Values are written as Python writes floats (shortest form, "nan", "inf"),
// except that integral values have no ".0". Unlike DeepSpeed, a resumed run does not write
// the header a second time. Its methods are safe for concurrent use.
type CSVWriter struct {
	dir    string
	append bool
	now    func() time.Time

	mu struct {
		sync.Mutex
		files     map[string]*csvFile // by tag
		line      []byte              // one row, reused
		lastFlush time.Time
		err       error // the first write error
		closed    bool
	}
}

type csvFile struct {
	f  *os.File
	bw *bufio.Writer
}

// CreateCSV creates dir if needed. With appendToExisting false (a fresh run) each file is
// truncated when the writer first writes to it; with it true (a resumed run) rows are appended.
func CreateCSV(dir string, appendToExisting bool, now func() time.Time) (*CSVWriter, error) {
	if now == nil {
		now = time.Now
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating csv monitor directory: %w", err)
	}
	c := &CSVWriter{dir: dir, append: appendToExisting, now: now}
	c.mu.files = map[string]*csvFile{}
	c.mu.lastFlush = now()
	return c, nil
}

// CSVFileName is the file DeepSpeed's csv_monitor writes tag to.
func CSVFileName(tag string) string {
	return strings.NewReplacer("/", "_", " ", "_").Replace(tag) + ".csv"
}

// Write appends one row per scalar, at step.
func (c *CSVWriter) Write(step int64, scalars []tbevents.Scalar) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.closed {
		return fmt.Errorf("csv monitor: step %d: %w", step, ErrClosed)
	}
	if c.mu.err != nil {
		return c.mu.err
	}
	for _, s := range scalars {
		f, err := c.fileLocked(s.Tag)
		if err != nil {
			c.mu.err = err
			return err
		}
		line := strconv.AppendInt(c.mu.line[:0], step, 10)
		line = append(line, ',')
		line = appendValue(line, s.Value)
		c.mu.line = append(line, '\n')
		if _, err := f.bw.Write(c.mu.line); err != nil {
			c.mu.err = fmt.Errorf("csv monitor: writing %s: %w", f.f.Name(), err)
			return c.mu.err
		}
	}
	if now := c.now(); now.Sub(c.mu.lastFlush) >= flushInterval {
		return c.flushLocked(now)
	}
	return nil
}

func (c *CSVWriter) fileLocked(tag string) (*csvFile, error) {
	if f, ok := c.mu.files[tag]; ok {
		return f, nil
	}
	path := filepath.Join(c.dir, CSVFileName(tag))
	flags := os.O_WRONLY | os.O_CREATE | os.O_TRUNC
	if c.append {
		flags = os.O_WRONLY | os.O_CREATE | os.O_APPEND
	}
	f, err := os.OpenFile(path, flags, 0o644)
	if err != nil {
		return nil, fmt.Errorf("csv monitor: %w", err)
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("csv monitor: %w", err)
	}
	cf := &csvFile{f: f, bw: bufio.NewWriterSize(f, 4<<10)}
	if st.Size() == 0 {
		header := tag[strings.LastIndexByte(tag, '/')+1:]
		cf.bw.WriteString("step," + header + "\n")
	}
	c.mu.files[tag] = cf
	return cf, nil
}

// appendValue formats v as Python's repr does for the ordinary range (DeepSpeed writes
// str(value)): plain decimals from 1e-4 up to 1e16, exponents outside, nan and inf spelled
// Python's way.
func appendValue(b []byte, v float64) []byte {
	switch a := math.Abs(v); {
	case math.IsNaN(v):
		return append(b, "nan"...)
	case math.IsInf(v, 1):
		return append(b, "inf"...)
	case math.IsInf(v, -1):
		return append(b, "-inf"...)
	case a == 0 || a >= 1e-4 && a < 1e16:
		return strconv.AppendFloat(b, v, 'f', -1, 64)
	default:
		return strconv.AppendFloat(b, v, 'e', -1, 64)
	}
}

// Flush writes the buffered rows to their files.
func (c *CSVWriter) Flush() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.closed {
		return fmt.Errorf("csv monitor: flush: %w", ErrClosed)
	}
	return c.flushLocked(c.now())
}

func (c *CSVWriter) flushLocked(now time.Time) error {
	if c.mu.err != nil {
		return c.mu.err
	}
	c.mu.lastFlush = now
	for _, f := range c.mu.files {
		if err := f.bw.Flush(); err != nil {
			c.mu.err = fmt.Errorf("csv monitor: writing %s: %w", f.f.Name(), err)
			return c.mu.err
		}
	}
	return nil
}

// Close flushes and closes the files. Calling it again returns nil.
func (c *CSVWriter) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.mu.closed {
		return nil
	}
	c.mu.closed = true
	err := c.flushLocked(c.now())
	for _, f := range c.mu.files {
		if cerr := f.f.Close(); cerr != nil && err == nil {
			err = fmt.Errorf("csv monitor: closing %s: %w", f.f.Name(), cerr)
		}
	}
	return err
}
