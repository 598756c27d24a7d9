package progress

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync"
	"time"

	"golang.org/x/term"
)

const (
	// minRedraw caps TTY redraws at ~10 a second: faster is unreadable and, over ssh, costs
	// bandwidth for nothing.
	minRedraw = 100 * time.Millisecond
	// DefaultInterval is how often plain mode prints a line: frequent enough to see a run is
	// alive in a CI log, rare enough that a day-long run's log stays readable (~8600 lines).
	DefaultInterval = 10 * time.Second
	// fallbackWidth is used when the terminal cannot tell its width.
	fallbackWidth = 100
	// clearLine returns to column 0 and erases to the end of the line.
	clearLine = "\r\x1b[K"
	// maxPendingLog bounds the bytes LogWriter holds back waiting for a newline.
	maxPendingLog = 64 << 10
)

// Status is what the progress line shows.
type Status struct {
	Step, TotalSteps int64 // TotalSteps <= 0: unknown, shown as "step 1200"
	Epoch, Epochs    int   // 1-based current epoch; Epoch <= 0 hides it, Epochs <= 0 hides "/N"
	Loss             float64
	SamplesPerSec    float64       // <= 0: not shown (no measurement yet)
	ETA              time.Duration // < 0 = unknown, not shown
	LossScale        float64       // 0 = not shown (only fp16 shows it)
	LR               float64       // 0 = not shown
}

// Config selects the mode and its parameters. The zero value is plain mode with the defaults.
type Config struct {
	// TTY selects in-place redrawing; set it from IsTerminal on the file out writes to.
	TTY bool
	// Width is the number of columns in TTY mode; 0 asks the terminal on every redraw (so a
	// resized window is followed), falling back to 100 when out is not a terminal.
	Width int
	// Interval between lines in plain mode; <= 0 means DefaultInterval.
	Interval time.Duration
	// Now is the clock used for throttling; nil means time.Now.
	Now func() time.Time
}

// Line is a progress line writing to one io.Writer.
type Line struct {
	out      io.Writer
	tty      bool
	width    func() int
	interval time.Duration
	now      func() time.Time

	mu struct {
		sync.Mutex
		status   Status
		have     bool      // an Update has been received
		shown    bool      // the latest status has been written (plain mode: avoids a duplicate at Done)
		onScreen bool      // TTY: the progress line is drawn on the current terminal line
		drawn    bool      // anything has been written yet
		last     time.Time // when the progress line was last written
		done     bool
		err      error
		buf      []byte
	}
}

// IsTerminal reports whether f is a terminal.
func IsTerminal(f *os.File) bool {
	return f != nil && term.IsTerminal(int(f.Fd()))
}

// New returns a Line writing to out.
func New(out io.Writer, cfg Config) *Line {
	l := &Line{
		out:      out,
		tty:      cfg.TTY,
		interval: cfg.Interval,
		now:      cfg.Now,
	}
	if l.interval <= 0 {
		l.interval = DefaultInterval
	}
	if l.now == nil {
		l.now = time.Now
	}
	switch f, ok := out.(interface{ Fd() uintptr }); {
	case cfg.Width > 0:
		w := cfg.Width
		l.width = func() int { return w }
	case ok:
		fd := int(f.Fd())
		l.width = func() int {
			if w, _, err := term.GetSize(fd); err == nil && w > 0 {
				return w
			}
			return fallbackWidth
		}
	default:
		l.width = func() int { return fallbackWidth }
	}
	return l
}

// Update records s and writes it if the mode's throttle allows.
func (l *Line) Update(s Status) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.mu.done || l.mu.err != nil {
		return
	}
	l.mu.status, l.mu.have, l.mu.shown = s, true, false
	now := l.now()
	gap := minRedraw
	if !l.tty {
		gap = l.interval
	}
	if !l.mu.drawn || now.Sub(l.mu.last) >= gap {
		l.showLocked(now, false)
	}
}

// Done writes the latest status a final time and ends the line: in TTY mode the line is
// redrawn and followed by a newline, so later output starts below it; in plain mode the last
// line is printed unless it already was. Calling Done again does nothing.
func (l *Line) Done() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.mu.done {
		return
	}
	l.mu.done = true
	if !l.mu.have || l.mu.err != nil {
		return
	}
	if l.tty || !l.mu.shown {
		l.showLocked(l.now(), true)
	}
	l.mu.onScreen = false
}

// Err returns the first error writing the progress line, after which the Line stopped drawing.
func (l *Line) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.mu.err
}

// showLocked writes the current status. final ends a TTY line with a newline.
func (l *Line) showLocked(now time.Time, final bool) {
	b := l.mu.buf[:0]
	if l.tty {
		b = append(b, clearLine...)
		text := len(b)
		b = AppendStatus(b, l.mu.status)
		// One column short of the width: writing the last column leaves some terminals in a
		// pending-wrap state where the next "\r" lands on a new line, stacking copies.
		if w := l.width() - 1; w >= 0 && len(b)-text > w {
			b = b[:text+w]
		}
		if final {
			b = append(b, '\n')
		}
	} else {
		b = AppendStatus(b, l.mu.status)
		b = append(b, '\n')
	}
	l.mu.buf = b
	l.mu.drawn, l.mu.last, l.mu.shown = true, now, true
	l.mu.onScreen = l.tty && !final
	if _, err := l.out.Write(b); err != nil {
		l.mu.err = fmt.Errorf("writing progress line: %w", err)
		l.mu.onScreen = false
	}
}

// AppendStatus appends the one-line rendering of s to b, e.g.
// "step 1200/9370 | epoch 2/10 | loss 0.4123 | 1832 samples/s | lr 9.5e-04 | ETA 3m07s".
// The text is ASCII, so its length in bytes is its width in columns.
func AppendStatus(b []byte, s Status) []byte {
	b = append(b, "step "...)
	b = strconv.AppendInt(b, s.Step, 10)
	if s.TotalSteps > 0 {
		b = append(b, '/')
		b = strconv.AppendInt(b, s.TotalSteps, 10)
	}
	if s.Epoch > 0 {
		b = append(b, " | epoch "...)
		b = strconv.AppendInt(b, int64(s.Epoch), 10)
		if s.Epochs > 0 {
			b = append(b, '/')
			b = strconv.AppendInt(b, int64(s.Epochs), 10)
		}
	}
	b = append(b, " | loss "...)
	b = strconv.AppendFloat(b, s.Loss, 'f', 4, 64)
	if s.SamplesPerSec > 0 {
		b = append(b, " | "...)
		b = strconv.AppendFloat(b, s.SamplesPerSec, 'f', 0, 64)
		b = append(b, " samples/s"...)
	}
	if s.LR != 0 {
		b = append(b, " | lr "...)
		b = strconv.AppendFloat(b, s.LR, 'e', 1, 64)
	}
	if s.ETA >= 0 {
		b = append(b, " | ETA "...)
		b = appendDuration(b, s.ETA)
	}
	if s.LossScale > 0 {
		b = append(b, " | scale "...)
		b = strconv.AppendFloat(b, s.LossScale, 'f', -1, 64)
	}
	return b
}

// FormatDuration formats d rounded to the second: "45s", "3m07s", "1h02m03s". Hours are not
// folded into days: an ETA of "50h00m00s" compares at a glance with "49h59m30s".
func FormatDuration(d time.Duration) string {
	return string(appendDuration(nil, d))
}

func appendDuration(b []byte, d time.Duration) []byte {
	// Work on the magnitude in uint64 so that the most negative Duration cannot overflow.
	mag := uint64(d)
	if d < 0 {
		b = append(b, '-')
		mag = -mag
	}
	secs := (mag + uint64(time.Second)/2) / uint64(time.Second)
	h, m, s := secs/3600, secs/60%60, secs%60
	switch {
	case h > 0:
		b = strconv.AppendUint(b, h, 10)
		b = append(b, 'h')
		b = append2(b, m)
		b = append(b, 'm')
		b = append2(b, s)
	case m > 0:
		b = strconv.AppendUint(b, m, 10)
		b = append(b, 'm')
		b = append2(b, s)
	default:
		b = strconv.AppendUint(b, s, 10)
	}
	return append(b, 's')
}

// append2 appends v (< 100) as two digits.
func append2(b []byte, v uint64) []byte {
	return append(b, byte('0'+v/10), byte('0'+v%10))
}

// LogWriter wraps w, the writer structured logs go to, so that in TTY mode each log line
// first clears the progress line, is written, and the progress line is redrawn below it. Log
// output is passed on in whole lines: a write without a trailing newline is held until the
// newline arrives (or Sync is called), since redrawing the progress line would erase a partial
// line from the screen. The returned writer has a Sync method, so zapcore.AddSync keeps it as
// a WriteSyncer. In plain mode writes go straight to w, serialised with the progress lines.
func (l *Line) LogWriter(w io.Writer) io.Writer {
	return &logWriter{l: l, w: w}
}

type logWriter struct {
	l       *Line
	w       io.Writer
	pending []byte // guarded by l.mu: the tail of a log line whose newline has not arrived
}

func (lw *logWriter) Write(p []byte) (int, error) {
	l := lw.l
	n := len(p)
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.tty || (!l.mu.onScreen && len(lw.pending) == 0 && bytes.HasSuffix(p, []byte{'\n'})) {
		// Nothing to protect on screen: write straight through.
		if _, err := lw.w.Write(p); err != nil {
			return 0, fmt.Errorf("writing log output: %w", err)
		}
		return n, nil
	}
	nl := bytes.LastIndexByte(p, '\n')
	if nl < 0 && len(lw.pending)+len(p) < maxPendingLog {
		lw.pending = append(lw.pending, p...)
		return n, nil
	}
	var line []byte
	if nl < 0 {
		// Too long without a newline: give up holding it and end it here.
		line = append(append(lw.pending, p...), '\n')
		p = p[:0]
	} else {
		line = append(lw.pending, p[:nl+1]...)
		p = p[nl+1:]
	}
	err := lw.writeLocked(line)
	lw.pending = append(lw.pending[:0], p...)
	if err != nil {
		return 0, err
	}
	return n, nil
}

// writeLocked clears the progress line, writes the complete log lines, and redraws.
func (lw *logWriter) writeLocked(lines []byte) error {
	l := lw.l
	if l.mu.onScreen {
		if _, err := l.out.Write([]byte(clearLine)); err != nil {
			l.mu.err = fmt.Errorf("writing progress line: %w", err)
		}
		l.mu.onScreen = false
	}
	_, werr := lw.w.Write(lines)
	if l.mu.have && !l.mu.done && l.mu.err == nil {
		l.showLocked(l.now(), false)
	}
	if werr != nil {
		return fmt.Errorf("writing log output: %w", werr)
	}
	return nil
}

// Sync writes any held partial log line, ending it with a newline, and syncs w if it can be.
func (lw *logWriter) Sync() error {
	l := lw.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(lw.pending) > 0 {
		line := append(lw.pending, '\n')
		lw.pending = lw.pending[:0]
		if err := lw.writeLocked(line); err != nil {
			return err
		}
	}
	if s, ok := lw.w.(interface{ Sync() error }); ok {
		if err := s.Sync(); err != nil {
			return fmt.Errorf("syncing log output: %w", err)
		}
	}
	return nil
}
