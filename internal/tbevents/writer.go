package tbevents

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// FilePrefix starts every event file's name; TensorBoard loads the files in a directory whose
// names contain "tfevents".
const FilePrefix = "events.out.tfevents."

const (
	// flushInterval bounds how long written events wait in the buffer while writes keep
	// coming: a write at least this long after the last flush flushes, so a run whose steps
	// take longer than this reaches the file at every step, and a fast run once a second.
	// TensorFlow's writer flushes every 120 s; a dashboard on a live run wants less.
	flushInterval = time.Second
	bufferSize    = 32 << 10
	// maxNameTries bounds the search for a free file name when another writer on this host
	// created one in the same second (a run restarted at once).
	maxNameTries = 100
)

// ErrClosed is returned by the Writer's methods after Close.
var ErrClosed = errors.New("tbevents: writer is closed")

// Options tunes Create. The zero value is valid.
type Options struct {
	// Hostname ends the file name; default os.Hostname().
	Hostname string
	// Now stamps the file name and the file_version event and times the flushes; default
	// time.Now.
	Now func() time.Time
	// Replace removes the event files already in the directory, so that a fresh run does not
	// show the curves of the run it replaces. Leave it false when resuming: TensorBoard then
	// reads the old files and the new one as one run.
	Replace bool
}

// Writer appends events to one event file. Its methods are safe for concurrent use.
type Writer struct {
	path string
	now  func() time.Time

	mu struct {
		sync.Mutex
		f         *os.File
		bw        *bufio.Writer
		event     []byte // one encoded event, reused
		scratch   []byte // the event framed as a record, reused
		lastFlush time.Time
		err       error // the first write error: the file is unusable after it
		closed    bool
	}
}

// Create creates dir if needed and a new event file in it, named
// events.out.tfevents.<unix seconds, 10 digits>.<hostname> (with ".1", ".2"... appended if
// that name is taken), and writes the file_version event.
func Create(dir string, opt Options) (*Writer, error) {
	if opt.Now == nil {
		opt.Now = time.Now
	}
	if opt.Hostname == "" {
		h, err := os.Hostname()
		if err != nil {
			return nil, fmt.Errorf("naming the event file: %w", err)
		}
		opt.Hostname = h
	}
	// A '/' would put the file in another directory; TensorFlow's hostnames never have one.
	host := strings.ReplaceAll(opt.Hostname, string(filepath.Separator), "_")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("creating event file directory: %w", err)
	}
	if opt.Replace {
		if err := removeEventFiles(dir); err != nil {
			return nil, err
		}
	}
	now := opt.Now()
	base := filepath.Join(dir, fmt.Sprintf("%s%010d.%s", FilePrefix, now.Unix(), host))
	var f *os.File
	var err error
	for i := 0; i < maxNameTries; i++ {
		path := base
		if i > 0 {
			path = fmt.Sprintf("%s.%d", base, i)
		}
		f, err = os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if !errors.Is(err, fs.ErrExist) {
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("creating event file: %w", err)
	}
	w := &Writer{path: f.Name(), now: opt.Now}
	w.mu.f = f
	w.mu.bw = bufio.NewWriterSize(f, bufferSize)
	w.mu.lastFlush = now
	// Whole seconds, as in the file name: TensorFlow's EventsWriter stamps its first event so.
	if err := w.WriteEvent(&Event{WallTime: float64(now.Unix()), FileVersion: FileVersion}); err != nil {
		f.Close()
		return nil, err
	}
	// The header reaches the disk at once, so TensorBoard lists the run from the start.
	if err := w.Flush(); err != nil {
		f.Close()
		return nil, err
	}
	return w, nil
}

func removeEventFiles(dir string) error {
	old, err := filepath.Glob(filepath.Join(dir, FilePrefix+"*"))
	if err != nil {
		return fmt.Errorf("listing old event files: %w", err)
	}
	for _, p := range old {
		if err := os.Remove(p); err != nil {
			return fmt.Errorf("removing old event file: %w", err)
		}
	}
	return nil
}

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }

// Path returns the event file's path.
func (w *Writer) Path() string { return w.path }

// WriteEvent appends e as one record. It reaches the file by the rules of flushInterval, and
// on Flush and Close.
func (w *Writer) WriteEvent(e *Event) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.mu.closed {
		return fmt.Errorf("writing event of step %d to %s: %w", e.Step, w.path, ErrClosed)
	}
	if w.mu.err != nil {
		return w.mu.err
	}
	w.mu.event = AppendEvent(w.mu.event[:0], e)
	w.mu.scratch = AppendRecord(w.mu.scratch[:0], w.mu.event)
	if _, err := w.mu.bw.Write(w.mu.scratch); err != nil {
		w.mu.err = fmt.Errorf("writing event of step %d to %s: %w", e.Step, w.path, err)
		return w.mu.err
	}
	if now := w.now(); now.Sub(w.mu.lastFlush) >= flushInterval {
		return w.flushLocked(now)
	}
	return nil
}

// WriteScalars appends one event holding scalars, at step and wall time t. scalars is not
// retained.
func (w *Writer) WriteScalars(step int64, t time.Time, scalars []Scalar) error {
	if scalars == nil {
		scalars = []Scalar{}
	}
	return w.WriteEvent(&Event{WallTime: unixSeconds(t), Step: step, Scalars: scalars})
}

// Flush writes the buffered events to the file.
func (w *Writer) Flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.mu.closed {
		return fmt.Errorf("flushing %s: %w", w.path, ErrClosed)
	}
	return w.flushLocked(w.now())
}

func (w *Writer) flushLocked(now time.Time) error {
	if w.mu.err != nil {
		return w.mu.err
	}
	w.mu.lastFlush = now
	if err := w.mu.bw.Flush(); err != nil {
		w.mu.err = fmt.Errorf("flushing %s: %w", w.path, err)
		return w.mu.err
	}
	return nil
}

// Close flushes and closes the file. Calling it again returns nil.
func (w *Writer) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.mu.closed {
		return nil
	}
	w.mu.closed = true
	err := w.flushLocked(w.now())
	if cerr := w.mu.f.Close(); cerr != nil && err == nil {
		err = fmt.Errorf("closing %s: %w", w.path, cerr)
	}
	return err
}

// ReadFile reads the events of an event file. A truncated last record (a writer still
// running, or killed) ends the list with an error wrapping ErrTruncated and the events before it.
func ReadFile(path string) ([]Event, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ReadEvents(f)
}

// ReadEvents reads the events of an event file from r; see ReadFile.
func ReadEvents(r io.Reader) ([]Event, error) {
	rr := NewRecordReader(r)
	var events []Event
	for {
		data, err := rr.Next()
		if err == io.EOF {
			return events, nil
		}
		if err != nil {
			return events, err
		}
		e, err := ParseEvent(data)
		if err != nil {
			return events, fmt.Errorf("record %d: %w", len(events), err)
		}
		events = append(events, e)
	}
}
