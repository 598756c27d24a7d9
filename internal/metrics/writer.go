package metrics

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"
	"time"
)

const (
	// flushInterval bounds how stale the file can be while a run is live: a record reaches the
	// file at most this long after Write, so `tail -f` and a dashboard polling the file keep up.
	flushInterval = time.Second
	// flushEvery bounds how much a crash can lose and how large the buffer grows on a fast
	// run; at ~250 bytes a record it is also roughly one 32 KiB buffer.
	flushEvery = 100
	// bufferSize is large enough that flushEvery records rarely force an early write(2).
	bufferSize = 32 << 10
	// tailChunk is how much of a file's end Create reads at a time looking for the last
	// newline; records are far shorter, so one chunk nearly always suffices.
	tailChunk = 4 << 10
)

// ErrClosed is returned by Write and Flush after Close.
var ErrClosed = errors.New("metrics: writer is closed")

// timer is the part of *time.Timer the Writer uses; tests substitute a manual one.
type timer interface{ Stop() bool }

// Writer appends Records to a metrics file, one JSON object per line. It is safe for concurrent
// use. See the package documentation for when buffered records reach the file.
type Writer struct {
	path string
	// afterFunc arms the background flush; time.AfterFunc outside tests.
	afterFunc func(time.Duration, func()) timer
	// flushes counts background flushes that are armed or running, so Close can wait for them:
	// after Close returns, nothing the Writer started still touches the file.
	flushes sync.WaitGroup

	mu struct {
		sync.Mutex
		f       *os.File
		bw      *bufio.Writer
		pending int    // records in bw not yet written to f
		timer   timer  // armed while pending > 0
		armed   uint64 // how many timers have been armed; identifies the current one
		closed  bool
		err     error // first error of a background flush, reported by the next call
	}
}

// Create opens the metrics file at path for writing, creating missing parent directories.
// With appendToExisting false an existing file is truncated (a fresh run); with it true records
// are appended (a run resumed from a checkpoint), after removing a truncated last line that a
// killed run may have left.
func Create(path string, appendToExisting bool) (*Writer, error) {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("creating directory for metrics file %s: %w", path, err)
		}
	}
	flags := os.O_WRONLY | os.O_CREATE | os.O_TRUNC
	if appendToExisting {
		// Read access is for finding the truncated tail; O_APPEND keeps every write at the end.
		flags = os.O_RDWR | os.O_CREATE | os.O_APPEND
	}
	f, err := os.OpenFile(path, flags, 0o644)
	if err != nil {
		return nil, fmt.Errorf("creating metrics file %s: %w", path, err)
	}
	if appendToExisting {
		if err := trimPartialLine(f); err != nil {
			f.Close()
			return nil, fmt.Errorf("opening metrics file %s for appending: %w", path, err)
		}
	}
	w := &Writer{
		path: path,
		afterFunc: func(d time.Duration, fn func()) timer {
			return time.AfterFunc(d, fn)
		},
	}
	w.mu.f = f
	w.mu.bw = bufio.NewWriterSize(f, bufferSize)
	return w, nil
}

// trimPartialLine truncates f after its last newline, dropping an incomplete final record.
func trimPartialLine(f *os.File) error {
	st, err := f.Stat()
	if err != nil {
		return err
	}
	end := st.Size()
	if end == 0 {
		return nil
	}
	buf := make([]byte, tailChunk)
	for pos := end; pos > 0; {
		n := int64(len(buf))
		if pos < n {
			n = pos
		}
		pos -= n
		if _, err := f.ReadAt(buf[:n], pos); err != nil && err != io.EOF {
			return fmt.Errorf("reading the end of the file: %w", err)
		}
		for i := n - 1; i >= 0; i-- {
			if buf[i] == '\n' {
				if cut := pos + i + 1; cut != end {
					return truncate(f, cut)
				}
				return nil
			}
		}
	}
	// No newline at all: the whole file is one incomplete record.
	return truncate(f, 0)
}

func truncate(f *os.File, size int64) error {
	if err := f.Truncate(size); err != nil {
		return fmt.Errorf("removing a truncated last record: %w", err)
	}
	return nil
}

// Path returns the file the Writer writes to.
func (w *Writer) Path() string { return w.path }

// Write appends r as one line. The line reaches the file within flushInterval, or sooner when
// flushEvery records are buffered or Flush or Close is called.
func (w *Writer) Write(r Record) error {
	line, err := r.MarshalJSON()
	if err != nil {
		return fmt.Errorf("encoding metrics record for step %d: %w", r.Step, err)
	}
	line = append(line, '\n')

	w.mu.Lock()
	defer w.mu.Unlock()
	if w.mu.closed {
		return fmt.Errorf("writing metrics record for step %d to %s: %w", r.Step, w.path, ErrClosed)
	}
	if err := w.takeErrLocked(); err != nil {
		return err
	}
	if _, err := w.mu.bw.Write(line); err != nil {
		return fmt.Errorf("writing metrics record for step %d to %s: %w", r.Step, w.path, err)
	}
	w.mu.pending++
	if w.mu.pending >= flushEvery {
		return w.flushLocked()
	}
	if w.mu.timer == nil {
		w.flushes.Add(1)
		w.mu.armed++
		id := w.mu.armed
		w.mu.timer = w.afterFunc(flushInterval, func() { w.backgroundFlush(id) })
	}
	return nil
}

// backgroundFlush runs on the timer with the given id, armed by Write. By the time it holds
// the lock, a Flush may have disarmed it and a later Write armed another; that newer timer must
// stay referenced so Close can stop it rather than wait for it.
func (w *Writer) backgroundFlush(id uint64) {
	defer w.flushes.Done()
	w.mu.Lock()
	defer w.mu.Unlock()
	if id != w.mu.armed || w.mu.timer == nil {
		return // superseded: its records were flushed by whoever disarmed it
	}
	w.mu.timer = nil
	if w.mu.closed || w.mu.pending == 0 {
		return
	}
	if err := w.flushLocked(); err != nil && w.mu.err == nil {
		w.mu.err = err
	}
}

// Flush writes buffered records to the file.
func (w *Writer) Flush() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.mu.closed {
		return fmt.Errorf("flushing metrics file %s: %w", w.path, ErrClosed)
	}
	if err := w.takeErrLocked(); err != nil {
		return err
	}
	return w.flushLocked()
}

func (w *Writer) flushLocked() error {
	w.stopTimerLocked()
	w.mu.pending = 0
	if err := w.mu.bw.Flush(); err != nil {
		return fmt.Errorf("flushing metrics file %s: %w", w.path, err)
	}
	return nil
}

// stopTimerLocked disarms the background flush. When Stop reports that the callback will not
// run, its WaitGroup count is released here instead; otherwise the callback is already waiting
// for the lock and releases it itself.
func (w *Writer) stopTimerLocked() {
	if w.mu.timer == nil {
		return
	}
	if w.mu.timer.Stop() {
		w.flushes.Done()
	}
	w.mu.timer = nil
}

func (w *Writer) takeErrLocked() error {
	err := w.mu.err
	w.mu.err = nil
	return err
}

// Close flushes buffered records and closes the file. It waits for a background flush in
// progress. Calling Close again returns nil.
func (w *Writer) Close() error {
	w.mu.Lock()
	if w.mu.closed {
		w.mu.Unlock()
		return nil
	}
	w.mu.closed = true
	err := w.takeErrLocked()
	if ferr := w.flushLocked(); err == nil {
		err = ferr
	}
	if cerr := w.mu.f.Close(); cerr != nil && err == nil {
		err = fmt.Errorf("closing metrics file %s: %w", w.path, cerr)
	}
	w.mu.Unlock()
	// A callback that fired before stopTimerLocked is blocked on the lock; let it finish.
	w.flushes.Wait()
	return err
}
