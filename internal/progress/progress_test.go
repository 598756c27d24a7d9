package progress

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *fakeClock { return &fakeClock{t: time.Date(2024, 1, 1, 0, 0, 0, 0, time.UTC)} }

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

func status(step int64) Status {
	return Status{Step: step, TotalSteps: 9370, Epoch: 2, Epochs: 10, Loss: 0.4123, SamplesPerSec: 1832, ETA: 187 * time.Second, LR: 9.5e-4}
}

func text(s Status) string { return string(AppendStatus(nil, s)) }

func TestAppendStatus(t *testing.T) {
	for _, c := range []struct {
		s    Status
		want string
	}{
		{status(1200), "step 1200/9370 | epoch 2/10 | loss 0.4123 | 1832 samples/s | lr 9.5e-04 | ETA 3m07s"},
		{func() Status { s := status(1200); s.LossScale = 65536; return s }(),
			"step 1200/9370 | epoch 2/10 | loss 0.4123 | 1832 samples/s | lr 9.5e-04 | ETA 3m07s | scale 65536"},
		{Status{Step: 3, Loss: math.NaN(), ETA: -1}, "step 3 | loss NaN"},
		{Status{Step: 3, Epoch: 1, Loss: 2, ETA: 0, LossScale: 0.5}, "step 3 | epoch 1 | loss 2.0000 | ETA 0s | scale 0.5"},
	} {
		if got := text(c.s); got != c.want {
			t.Errorf("AppendStatus(%+v)\n got %q\nwant %q", c.s, got, c.want)
		}
	}
}

func TestFormatDuration(t *testing.T) {
	for _, c := range []struct {
		d    time.Duration
		want string
	}{
		{0, "0s"},
		{45 * time.Second, "45s"},
		{3*time.Minute + 7*time.Second, "3m07s"},
		{time.Hour + 2*time.Minute + 3*time.Second, "1h02m03s"},
		{59*time.Second + 600*time.Millisecond, "1m00s"},
		{50 * time.Hour, "50h00m00s"},
		{-5 * time.Second, "-5s"},
		{time.Duration(math.MinInt64), "-2562047h47m17s"},
	} {
		if got := FormatDuration(c.d); got != c.want {
			t.Errorf("FormatDuration(%v) = %q, want %q", c.d, got, c.want)
		}
	}
}

func TestTTYRedrawAndThrottle(t *testing.T) {
	var buf bytes.Buffer
	clk := newClock()
	l := New(&buf, Config{TTY: true, Width: 200, Now: clk.Now})

	l.Update(status(1))
	want := clearLine + text(status(1))
	if buf.String() != want {
		t.Fatalf("first update:\n got %q\nwant %q", buf.String(), want)
	}
	clk.Advance(50 * time.Millisecond)
	l.Update(status(2))
	if buf.String() != want {
		t.Fatalf("update 50ms later was drawn: %q", buf.String())
	}
	clk.Advance(50 * time.Millisecond)
	l.Update(status(3))
	want += clearLine + text(status(3))
	if buf.String() != want {
		t.Fatalf("update 100ms after the first:\n got %q\nwant %q", buf.String(), want)
	}
	clk.Advance(time.Millisecond)
	l.Update(status(4)) // throttled, but Done must show it
	l.Done()
	want += clearLine + text(status(4)) + "\n"
	if buf.String() != want {
		t.Fatalf("after Done:\n got %q\nwant %q", buf.String(), want)
	}
	l.Done()
	clk.Advance(time.Hour)
	l.Update(status(5))
	if buf.String() != want {
		t.Fatalf("output after Done: %q", buf.String()[len(want):])
	}
}

func TestDoneWithoutUpdates(t *testing.T) {
	for _, tty := range []bool{true, false} {
		var buf bytes.Buffer
		l := New(&buf, Config{TTY: tty})
		l.Done()
		if buf.Len() != 0 {
			t.Fatalf("tty=%v: Done with nothing to show wrote %q", tty, buf.String())
		}
	}
}

func TestWidthTruncation(t *testing.T) {
	var buf bytes.Buffer
	l := New(&buf, Config{TTY: true, Width: 30, Now: newClock().Now})
	s := status(1200)
	s.LossScale = 65536
	l.Update(s)
	l.Done()
	full := text(s)
	for _, seg := range strings.Split(buf.String(), clearLine)[1:] {
		seg = strings.TrimSuffix(seg, "\n")
		if len(seg) != 29 || !strings.HasPrefix(full, seg) {
			t.Fatalf("segment %q: want the first 29 columns of %q", seg, full)
		}
	}
}

// A Line on a file that is not a terminal, with Width 0, falls back to 100 columns.
func TestWidthFallback(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if IsTerminal(f) || IsTerminal(nil) {
		t.Fatal("a regular file (or nil) is not a terminal")
	}
	l := New(f, Config{TTY: true, Now: newClock().Now})
	s := status(1)
	s.LossScale = 1e30 // long enough to need cutting
	l.Update(s)
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if got := len(b) - len(clearLine); got != fallbackWidth-1 {
		t.Fatalf("line is %d columns, want %d", got, fallbackWidth-1)
	}
}

func TestPlainMode(t *testing.T) {
	var buf bytes.Buffer
	clk := newClock()
	l := New(&buf, Config{Now: clk.Now}) // zero Interval: DefaultInterval
	for step := int64(0); step <= 25; step++ {
		l.Update(status(step))
		clk.Advance(time.Second)
	}
	l.Done()
	l.Done()
	got := buf.String()
	if strings.ContainsAny(got, "\r\x1b") {
		t.Fatalf("plain output has control characters: %q", got)
	}
	want := text(status(0)) + "\n" + text(status(10)) + "\n" + text(status(20)) + "\n" + text(status(25)) + "\n"
	if got != want {
		t.Fatalf("plain output:\n got %q\nwant %q", got, want)
	}
}

func TestPlainModeNoDuplicateAtDone(t *testing.T) {
	var buf bytes.Buffer
	clk := newClock()
	l := New(&buf, Config{Interval: time.Minute, Now: clk.Now})
	l.Update(status(1))
	l.Done()
	if got, want := buf.String(), text(status(1))+"\n"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
}

func TestLogWriterTTY(t *testing.T) {
	var screen bytes.Buffer
	clk := newClock()
	l := New(&screen, Config{TTY: true, Width: 200, Now: clk.Now})
	lw := l.LogWriter(&screen)

	// Before the first update there is no progress line to protect.
	fmt.Fprint(lw, "starting\n")
	want := "starting\n"
	if screen.String() != want {
		t.Fatalf("log before progress: %q", screen.String())
	}

	l.Update(status(1))
	want += clearLine + text(status(1))
	fmt.Fprint(lw, "log one\n")
	want += clearLine + "log one\n" + clearLine + text(status(1))
	if screen.String() != want {
		t.Fatalf("clear, log, redraw:\n got %q\nwant %q", screen.String(), want)
	}

	// A throttled update is what the redraw after a log line shows.
	clk.Advance(time.Millisecond)
	l.Update(status(2))
	fmt.Fprint(lw, "part")
	if screen.String() != want {
		t.Fatalf("a partial log line was written before its newline: %q", screen.String()[len(want):])
	}
	fmt.Fprint(lw, "ial\nnext")
	want += clearLine + "partial\n" + clearLine + text(status(2))
	if screen.String() != want {
		t.Fatalf("completed partial line:\n got %q\nwant %q", screen.String(), want)
	}
	if err := lw.(interface{ Sync() error }).Sync(); err != nil {
		t.Fatal(err)
	}
	want += clearLine + "next\n" + clearLine + text(status(2))
	if screen.String() != want {
		t.Fatalf("Sync of held text:\n got %q\nwant %q", screen.String(), want)
	}

	l.Done()
	want += clearLine + text(status(2)) + "\n"
	fmt.Fprint(lw, "after\n")
	want += "after\n"
	if screen.String() != want {
		t.Fatalf("after Done:\n got %q\nwant %q", screen.String(), want)
	}
}

func TestLogWriterSeparateWriter(t *testing.T) {
	var out, logs bytes.Buffer
	l := New(&out, Config{TTY: true, Width: 200, Now: newClock().Now})
	lw := l.LogWriter(&logs)
	l.Update(status(1))
	fmt.Fprint(lw, "a\nb\n")
	if logs.String() != "a\nb\n" {
		t.Fatalf("log writer got %q", logs.String())
	}
	if want := clearLine + text(status(1)) + clearLine + clearLine + text(status(1)); out.String() != want {
		t.Fatalf("progress writer:\n got %q\nwant %q", out.String(), want)
	}
}

func TestLogWriterLongLineWithoutNewline(t *testing.T) {
	var screen bytes.Buffer
	l := New(&screen, Config{TTY: true, Width: 200, Now: newClock().Now})
	lw := l.LogWriter(&screen)
	l.Update(status(1))
	long := strings.Repeat("x", maxPendingLog)
	if n, err := lw.Write([]byte(long)); n != len(long) || err != nil {
		t.Fatalf("Write = %d, %v", n, err)
	}
	if !strings.Contains(screen.String(), long+"\n"+clearLine) {
		t.Fatal("an over-long partial line was not flushed as a line")
	}
}

func TestLogWriterPlainPassThrough(t *testing.T) {
	var buf bytes.Buffer
	l := New(&buf, Config{Now: newClock().Now})
	lw := l.LogWriter(&buf)
	l.Update(status(1))
	fmt.Fprint(lw, "partial")
	fmt.Fprint(lw, " line\n")
	if got, want := buf.String(), text(status(1))+"\npartial line\n"; got != want {
		t.Fatalf("got %q, want %q", got, want)
	}
}

// zapcore.AddSync keeps the writer's Sync, and zap's entries come out whole between redraws.
func TestLogWriterWithZap(t *testing.T) {
	var screen bytes.Buffer
	l := New(&screen, Config{TTY: true, Width: 200, Now: newClock().Now})
	enc := zapcore.NewConsoleEncoder(zapcore.EncoderConfig{MessageKey: "msg", LineEnding: "\n"})
	logger := zap.New(zapcore.NewCore(enc, zapcore.AddSync(l.LogWriter(&screen)), zap.InfoLevel))
	l.Update(status(1))
	logger.Info("checkpoint saved")
	if err := logger.Sync(); err != nil {
		t.Fatal(err)
	}
	want := clearLine + text(status(1)) + clearLine + "checkpoint saved\n" + clearLine + text(status(1))
	if screen.String() != want {
		t.Fatalf("\n got %q\nwant %q", screen.String(), want)
	}
}

type failingWriter struct{ writes int }

func (f *failingWriter) Write([]byte) (int, error) { f.writes++; return 0, errors.New("terminal gone") }

func TestWriteErrorStopsDrawing(t *testing.T) {
	out := &failingWriter{}
	clk := newClock()
	l := New(out, Config{TTY: true, Width: 80, Now: clk.Now})
	l.Update(status(1))
	if err := l.Err(); err == nil || !strings.Contains(err.Error(), "terminal gone") {
		t.Fatalf("Err() = %v", err)
	}
	clk.Advance(time.Second)
	l.Update(status(2))
	l.Done()
	if out.writes != 1 {
		t.Fatalf("%d writes after a failure, want 1", out.writes)
	}
	var logs bytes.Buffer
	if _, err := fmt.Fprint(l.LogWriter(&logs), "still logged\n"); err != nil || logs.String() != "still logged\n" {
		t.Fatalf("logging after a progress failure: %q, %v", logs.String(), err)
	}
}

// Updates and log lines from several goroutines: every log line must reach the screen whole,
// right after a clear, and the screen must be a sequence of progress lines and log lines.
// The Line serialises all writes to screen, so a plain bytes.Buffer is enough (-race checks it).
func TestConcurrentUpdateAndLog(t *testing.T) {
	var screen bytes.Buffer
	clk := newClock()
	l := New(&screen, Config{TTY: true, Width: 200, Now: clk.Now})
	l.Update(status(0)) // so that every log line has a progress line to clear
	const updaters, loggers, each = 2, 3, 200
	var wg sync.WaitGroup
	for u := range updaters {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				clk.Advance(30 * time.Millisecond)
				l.Update(status(int64(u*each + i)))
			}
		}()
	}
	for g := range loggers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			lw := l.LogWriter(&screen)
			for i := range each {
				// Split writes exercise the partial-line path under contention.
				fmt.Fprintf(lw, "log %d-", g)
				fmt.Fprintf(lw, "%d\n", i)
			}
		}()
	}
	wg.Wait()
	l.Done()

	progressRe := regexp.MustCompile(`^step \d+/9370 \| [^\r\x1b\n]*$`)
	logRe := regexp.MustCompile(`^log (\d)-(\d+)\n$`)
	seen := map[string]bool{}
	segs := strings.Split(screen.String(), clearLine)
	if segs[0] != "" {
		t.Fatalf("output starts with %q, not a clear", segs[0])
	}
	for i, seg := range segs[1:] {
		switch {
		case progressRe.MatchString(seg):
		case i == len(segs)-2 && progressRe.MatchString(strings.TrimSuffix(seg, "\n")):
		case logRe.MatchString(seg):
			if seen[seg] {
				t.Fatalf("log line %q twice", seg)
			}
			seen[seg] = true
		default:
			t.Fatalf("segment %d is neither a progress line nor a whole log line: %q", i, seg)
		}
	}
	if len(seen) != loggers*each {
		t.Fatalf("%d distinct log lines, want %d", len(seen), loggers*each)
	}
}
