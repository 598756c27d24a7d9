package tbevents

import (
	"bytes"
	"errors"
	"hash/crc32"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestCRCVectors checks the checksum against published values: CRC-32C's check value and
// RFC 3720's example, and masked CRCs taken from event files TensorFlow wrote (rustboard's
// masked_crc.rs and tf_record.rs tests).
func TestCRCVectors(t *testing.T) {
	if got := crc32.Checksum([]byte("123456789"), castagnoli); got != 0xe3069283 {
		t.Errorf("CRC32C(123456789) = %#08x, want 0xe3069283", got)
	}
	if got, want := MaskedCRC(make([]byte, 32)), mask(0x8a9136aa); got != want { // RFC 3720 B.4, 32 zero bytes
		t.Errorf("masked CRC of 32 zeros = %#08x, want %#08x", got, want)
	}
	for _, c := range []struct {
		data string
		want uint32
	}{
		{"\x1a\x11CRC test, one two", 0x5794d08a},
		{"\x18\x00\x00\x00\x00\x00\x00\x00", 0x224b7fa3}, // the length 24 of a header record
		{"\x09\x00\x00\x80\x38\x99\xd6\xd7\x41\x1a\x0dbrain.Event:2", 0xab364b12},
	} {
		if got := MaskedCRC([]byte(c.data)); got != c.want {
			t.Errorf("MaskedCRC(%q) = %#08x, want %#08x", c.data, got, c.want)
		}
	}
}

// records splits a file into its raw records (header, data, footer), checking nothing.
func records(t *testing.T, b []byte) [][]byte {
	t.Helper()
	var out [][]byte
	for len(b) > 0 {
		if len(b) < headerLen {
			t.Fatalf("%d trailing bytes", len(b))
		}
		n := headerLen + int(b[0]) | int(b[1])<<8 | int(b[2])<<16 // records here are small
		n += footerLen
		out = append(out, b[:n])
		b = b[n:]
	}
	return out
}

// TestReferenceFiles reads the files TensorFlow wrote and checks that the writer's framing
// and encoding give back the same bytes: the whole of end_2_end.tfevents (header and
// simple_value scalars), and the framing of every record of the TF2 file, whose scalar is a
// tensor the writer does not produce.
func TestReferenceFiles(t *testing.T) {
	ref, err := os.ReadFile("testdata/end_2_end.tfevents")
	if err != nil {
		t.Fatal(err)
	}
	events, err := ReadEvents(bytes.NewReader(ref))
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != 25 || events[0].FileVersion != FileVersion || events[0].WallTime != 1551753597 {
		t.Fatalf("header %+v of %d events", events[0], len(events))
	}
	first, last := events[1], events[24]
	if first.WallTime != 1551753597.3618679 || len(first.Scalars) != 1 || first.Scalars[0] != (Scalar{"train_begin", 0}) {
		t.Errorf("event 1 = %+v", first)
	}
	if len(last.Scalars) != 1 || last.Scalars[0].Tag != "predict_end" {
		t.Errorf("event 24 = %+v", last)
	}

	// The same events through Writer: byte for byte the same file.
	dir := t.TempDir()
	w, err := Create(dir, Options{Hostname: "ref", Now: func() time.Time { return time.Unix(1551753597, 250e6) }})
	if err != nil {
		t.Fatal(err)
	}
	if want := filepath.Join(dir, "events.out.tfevents.1551753597.ref"); w.Path() != want {
		t.Errorf("path %s, want %s", w.Path(), want)
	}
	for i := range events[1:] {
		if err := w.WriteEvent(&events[1+i]); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(w.Path())
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, ref) {
		g, r := records(t, got), records(t, ref)
		for i := range min(len(g), len(r)) {
			if !bytes.Equal(g[i], r[i]) {
				t.Fatalf("record %d differs:\n got %x\nwant %x", i, g[i], r[i])
			}
		}
		t.Fatalf("%d records, want %d", len(g), len(r))
	}

	tf2, err := os.ReadFile("testdata/tf2_scalar_accuracy.tfevents")
	if err != nil {
		t.Fatal(err)
	}
	events, err = ReadEvents(bytes.NewReader(tf2))
	if err != nil {
		t.Fatal(err)
	}
	want := Event{WallTime: 1599759606.8597269, Step: 77, Scalars: []Scalar{{"accuracy", float64(float32(0.99))}}}
	if len(events) != 2 || events[0].FileVersion != FileVersion || !equalEvent(events[1], want) {
		t.Fatalf("events %+v, want the header and %+v", events, want)
	}
	rr := NewRecordReader(bytes.NewReader(tf2))
	for i, raw := range records(t, tf2) {
		data, err := rr.Next()
		if err != nil {
			t.Fatal(err)
		}
		if framed := AppendRecord(nil, data); !bytes.Equal(framed, raw) {
			t.Errorf("record %d framed as %x, want %x", i, framed, raw)
		}
	}
	// The header event, encoded by the writer, is TensorFlow's.
	if hdr := AppendRecord(nil, AppendEvent(nil, &Event{WallTime: 1599759586, FileVersion: FileVersion})); !bytes.Equal(hdr, records(t, tf2)[0]) {
		t.Errorf("header %x, want %x", hdr, records(t, tf2)[0])
	}
	// The writer's form of the same scalar (simple_value) reads back the same.
	back, err := ParseEvent(AppendEvent(nil, &want))
	if err != nil || !equalEvent(back, want) {
		t.Errorf("simple_value round trip = %+v, %v; want %+v", back, err, want)
	}
}

func equalEvent(a, b Event) bool {
	if a.WallTime != b.WallTime || a.Step != b.Step || a.FileVersion != b.FileVersion || a.SessionStart != b.SessionStart ||
		(a.Scalars == nil) != (b.Scalars == nil) || len(a.Scalars) != len(b.Scalars) {
		return false
	}
	for i := range a.Scalars {
		x, y := a.Scalars[i], b.Scalars[i]
		if x.Tag != y.Tag || !(x.Value == y.Value || math.IsNaN(x.Value) && math.IsNaN(y.Value)) {
			return false
		}
	}
	return true
}

func TestEventRoundTrip(t *testing.T) {
	for _, e := range []Event{
		{WallTime: 1.5, FileVersion: FileVersion},
		{WallTime: 1e9, Step: 1, Scalars: []Scalar{{"train/loss", 2.25}, {"train/lr", 0}, {"", -1}}},
		{WallTime: 2, Step: -3, Scalars: []Scalar{{"nan", math.NaN()}, {"inf", math.Inf(-1)}}},
		{Step: 1 << 40, Scalars: []Scalar{}},
		{WallTime: 3, Step: 10, SessionStart: true},
		{},
	} {
		got, err := ParseEvent(AppendEvent(nil, &e))
		if err != nil || !equalEvent(got, e) {
			t.Errorf("round trip of %+v = %+v, %v", e, got, err)
		}
	}
}

func TestParseMalformed(t *testing.T) {
	if _, err := ParseEvent([]byte{0x2a, 0x05, 0x0a}); !errors.Is(err, errMalformed) {
		t.Errorf("summary longer than the message: %v, want errMalformed", err)
	}
	if _, err := ParseEvent([]byte{0xff}); !errors.Is(err, errMalformed) {
		t.Errorf("bad tag: %v, want errMalformed", err)
	}
}

func FuzzParseEvent(f *testing.F) {
	f.Add(AppendEvent(nil, &Event{WallTime: 1, Step: 2, Scalars: []Scalar{{"a", 1}}}))
	if b, err := os.ReadFile("testdata/tf2_scalar_accuracy.tfevents"); err == nil && len(b) > 50 {
		f.Add(b[52 : len(b)-4])
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		if e, err := ParseEvent(b); err == nil {
			ParseEvent(AppendEvent(nil, &e)) // must not panic either
		}
	})
}

// TestReaderDamage: a file cut anywhere reads its whole records and then ErrTruncated; a
// flipped bit anywhere is ErrCorrupt (or, in a length, possibly truncation), never a panic or
// a wrong event.
func TestReaderDamage(t *testing.T) {
	var file []byte
	file = AppendRecord(file, AppendEvent(nil, &Event{WallTime: 1, FileVersion: FileVersion}))
	one := len(file)
	file = AppendRecord(file, AppendEvent(nil, &Event{WallTime: 2, Step: 5, Scalars: []Scalar{{"x", 3}}}))
	for cut := 1; cut < len(file); cut++ {
		events, err := ReadEvents(bytes.NewReader(file[:cut]))
		wantEvents := 0
		if cut >= one {
			wantEvents = 1
		}
		if cut == one {
			if err != nil || len(events) != 1 {
				t.Errorf("cut at the record boundary: %d events, %v", len(events), err)
			}
			continue
		}
		if !errors.Is(err, ErrTruncated) || len(events) != wantEvents {
			t.Errorf("cut at %d: %d events, %v; want %d and ErrTruncated", cut, len(events), err, wantEvents)
		}
	}
	for i := range file {
		for bit := range 8 {
			bad := bytes.Clone(file)
			bad[i] ^= 1 << bit
			_, err := ReadEvents(bytes.NewReader(bad))
			if !errors.Is(err, ErrCorrupt) && !errors.Is(err, ErrTruncated) {
				t.Fatalf("byte %d bit %d flipped: %v, want ErrCorrupt", i, bit, err)
			}
		}
	}
	rr := NewRecordReader(bytes.NewReader(nil))
	if _, err := rr.Next(); err != io.EOF {
		t.Errorf("empty input: %v, want io.EOF", err)
	}
}

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func TestWriterFlushAndNames(t *testing.T) {
	dir := t.TempDir()
	clk := &clock{t: time.Unix(1700000000, 0)}
	opt := Options{Hostname: "h/x", Now: clk.now}
	w, err := Create(dir, opt)
	if err != nil {
		t.Fatal(err)
	}
	if base := filepath.Base(w.Path()); base != "events.out.tfevents.1700000000.h_x" {
		t.Errorf("name %s", base)
	}
	onDisk := func() []Event {
		t.Helper()
		ev, err := ReadFile(w.Path())
		if err != nil {
			t.Fatal(err)
		}
		return ev
	}
	if ev := onDisk(); len(ev) != 1 || ev[0].FileVersion != FileVersion {
		t.Fatalf("after Create: %+v, want the header on disk", ev)
	}
	clk.add(100 * time.Millisecond)
	if err := w.WriteScalars(1, clk.now(), []Scalar{{"loss", 1}}); err != nil {
		t.Fatal(err)
	}
	if n := len(onDisk()); n != 1 {
		t.Errorf("a write within flushInterval reached the file (%d events)", n)
	}
	clk.add(flushInterval)
	if err := w.WriteScalars(2, clk.now(), []Scalar{{"loss", 0.5}}); err != nil {
		t.Fatal(err)
	}
	ev := onDisk()
	if len(ev) != 3 || ev[2].Step != 2 || ev[2].WallTime != 1700000001.1 {
		t.Errorf("after flushInterval: %+v", ev)
	}
	// A second writer in the same second (a restart) gets the next free name and leaves the
	// first file alone; Replace removes both.
	opt2 := opt
	opt2.Now = func() time.Time { return time.Unix(1700000000, 5e8) }
	w2, err := Create(dir, opt2)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(w2.Path(), ".h_x.1") {
		t.Errorf("second name %s", w2.Path())
	}
	if err := w.Close(); err != nil || w.Close() != nil {
		t.Errorf("Close: %v", err)
	}
	if err := w.WriteScalars(3, clk.now(), nil); !errors.Is(err, ErrClosed) {
		t.Errorf("write after Close: %v", err)
	}
	w2.Close()
	opt.Replace = true
	w3, err := Create(dir, opt)
	if err != nil {
		t.Fatal(err)
	}
	defer w3.Close()
	left, _ := filepath.Glob(filepath.Join(dir, FilePrefix+"*"))
	if len(left) != 1 || left[0] != w3.Path() {
		t.Errorf("after Replace: %v", left)
	}
}

// TestWriteAllocs: the per-step write allocates nothing once the buffers have grown.
func TestWriteAllocs(t *testing.T) {
	w, err := Create(t.TempDir(), Options{Hostname: "h"})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	scalars := []Scalar{{"train/loss", 1}, {"train/lr", 1e-3}, {"train/samples_per_sec", 1000}}
	now := time.Now()
	w.WriteScalars(0, now, scalars)
	if n := testing.AllocsPerRun(100, func() { w.WriteScalars(1, now, scalars) }); n != 0 {
		t.Errorf("%v allocations per write", n)
	}
}
