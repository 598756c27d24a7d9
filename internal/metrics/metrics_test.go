package metrics

import (
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"
)

// manualTimer stands in for time.AfterFunc: the test decides when (and whether) it fires.
type manualTimer struct {
	fn func()

	mu      sync.Mutex
	stopped bool
	fired   bool
	// stopFails simulates a timer that has already fired and whose callback is waiting for
	// the Writer's lock: Stop reports false, and the test must fire it.
	stopFails bool
}

func (t *manualTimer) Stop() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.stopFails || t.fired || t.stopped {
		return false
	}
	t.stopped = true
	return true
}

// fire runs the callback as the runtime would, unless the timer was stopped or has fired.
func (t *manualTimer) fire() bool {
	t.mu.Lock()
	if t.stopped || t.fired {
		t.mu.Unlock()
		return false
	}
	t.fired = true
	t.mu.Unlock()
	t.fn()
	return true
}

func (t *manualTimer) isStopped() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.stopped
}

func (t *manualTimer) failStop() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.stopFails = true
}

type manualClock struct {
	mu     sync.Mutex
	timers []*manualTimer
}

func (c *manualClock) afterFunc(_ time.Duration, fn func()) timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &manualTimer{fn: fn}
	c.timers = append(c.timers, t)
	return t
}

func (c *manualClock) last() *manualTimer {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.timers) == 0 {
		return nil
	}
	return c.timers[len(c.timers)-1]
}

func newTestWriter(t *testing.T, path string, appendToExisting bool) (*Writer, *manualClock) {
	t.Helper()
	w, err := Create(path, appendToExisting)
	if err != nil {
		t.Fatal(err)
	}
	clk := &manualClock{}
	w.afterFunc = clk.afterFunc
	t.Cleanup(func() { w.Close() })
	return w, clk
}

func trainRec(step int64) Record {
	return Record{Kind: KindTrain, Time: 1.7e9 + float64(step), Step: step, Epoch: float64(step) / 100, Loss: 1 / float64(step+1), LR: 1e-3}
}

func countLines(t *testing.T, path string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Count(b, []byte{'\n'})
}

// fullRecord sets every field of Record to a distinct non-zero value by reflection, so a field
// added to Record later is covered without editing this test.
func fullRecord() Record {
	var r Record
	v := reflect.ValueOf(&r).Elem()
	for i := 0; i < v.NumField(); i++ {
		f := v.Field(i)
		switch f.Kind() {
		case reflect.String:
			f.SetString(fmt.Sprintf("s%d", i))
		case reflect.Float64:
			f.SetFloat(float64(i) + 0.25)
		case reflect.Int, reflect.Int64:
			f.SetInt(int64(i) + 1)
		case reflect.Uint64:
			f.SetUint(uint64(i) + 1)
		case reflect.Bool:
			f.SetBool(true)
		case reflect.Map:
			m := reflect.MakeMap(f.Type())
			m.SetMapIndex(reflect.ValueOf(fmt.Sprintf("k%d", i)), reflect.ValueOf(i+1).Convert(f.Type().Elem()))
			f.Set(m)
		case reflect.Slice:
			e := reflect.New(f.Type().Elem()).Elem()
			if e.Kind() == reflect.Struct && e.NumField() > 0 && e.Field(0).Kind() == reflect.String {
				e.Field(0).SetString(fmt.Sprintf("e%d", i))
			}
			f.Set(reflect.Append(reflect.MakeSlice(f.Type(), 0, 1), e))
		default:
			panic("fullRecord: add a case for " + f.Kind().String())
		}
	}
	return r
}

func TestWireRecordMirrorsRecord(t *testing.T) {
	rt, wt := reflect.TypeOf(Record{}), reflect.TypeOf(wireRecord{})
	if rt.NumField() != wt.NumField() {
		t.Fatalf("Record has %d fields, wireRecord %d: update json.go", rt.NumField(), wt.NumField())
	}
	for i := 0; i < rt.NumField(); i++ {
		rf, wf := rt.Field(i), wt.Field(i)
		if rf.Name != wf.Name || rf.Tag != wf.Tag {
			t.Errorf("field %d: Record has %s %q, wireRecord %s %q", i, rf.Name, rf.Tag, wf.Name, wf.Tag)
		}
	}
}

func TestJSONFieldNames(t *testing.T) {
	b, err := json.Marshal(fullRecord())
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	var got []string
	for k := range m {
		got = append(got, k)
	}
	sort.Strings(got)
	want := append([]string(nil), CSVHeader...)
	sort.Strings(want)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("JSON keys %v, want %v", got, want)
	}
	// Omitted when zero, as documented on Record.
	b, _ = json.Marshal(Record{Kind: KindEval, Step: 3, Accuracy: 0.5})
	if s := string(b); strings.Contains(s, "lr") || strings.Contains(s, "skipped") || !strings.Contains(s, `"loss":0`) {
		t.Fatalf("omitempty not honoured: %s", s)
	}
}

func TestRoundTripEveryField(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.jsonl")
	w, _ := newTestWriter(t, path, false)
	want := []Record{fullRecord(), trainRec(7)}
	// The same record with a non-finite float takes the other encoding path.
	nonFinite := fullRecord()
	nonFinite.GradNorm = math.NaN()
	for _, r := range append(want, nonFinite) {
		if err := w.Write(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 {
		t.Fatalf("read %d records, want 3", len(got))
	}
	if !reflect.DeepEqual(got[:2], want) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got[:2], want)
	}
	g := got[2]
	if !math.IsNaN(g.GradNorm) {
		t.Fatalf("grad_norm = %v, want NaN", g.GradNorm)
	}
	g.GradNorm = nonFinite.GradNorm
	nonFinite.GradNorm, g.GradNorm = 0, 0
	if !reflect.DeepEqual(g, nonFinite) {
		t.Fatalf("non-finite path:\n got %+v\nwant %+v", g, nonFinite)
	}
}

func TestNonFiniteWrittenAsNull(t *testing.T) {
	r := trainRec(5)
	r.Loss = math.NaN()
	r.Scale = math.Inf(1)
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatalf("a NaN loss must still be encodable: %v", err)
	}
	s := string(b)
	if !strings.Contains(s, `"loss":null`) || !strings.Contains(s, `"scale":null`) {
		t.Fatalf("non-finite floats not written as null: %s", s)
	}
	if !strings.Contains(s, `"time":1700000005,`) || !strings.Contains(s, `"lr":0.001`) {
		t.Fatalf("finite floats in the null path should look like encoding/json's: %s", s)
	}
	var back Record
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if !math.IsNaN(back.Loss) || !math.IsNaN(back.Scale) || back.Step != 5 || back.LR != 1e-3 {
		t.Fatalf("decoded %+v", back)
	}
}

func TestFlushPolicy(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.jsonl")
	w, clk := newTestWriter(t, path, false)

	if err := w.Write(trainRec(1)); err != nil {
		t.Fatal(err)
	}
	if n := countLines(t, path); n != 0 {
		t.Fatalf("%d lines on disk right after one Write; want it buffered", n)
	}
	tm := clk.last()
	if tm == nil {
		t.Fatal("Write buffered a record without arming the background flush")
	}
	if !tm.fire() { // a second of wall time has passed
		t.Fatal("timer stopped early")
	}
	if n := countLines(t, path); n != 1 {
		t.Fatalf("%d lines after the background flush, want 1", n)
	}

	// flushEvery records are written without waiting for the timer.
	for i := int64(2); i < 2+flushEvery; i++ {
		if err := w.Write(trainRec(i)); err != nil {
			t.Fatal(err)
		}
	}
	if n := countLines(t, path); n != 1+flushEvery {
		t.Fatalf("%d lines after %d more writes, want %d", n, flushEvery, 1+flushEvery)
	}
	if !clk.timers[1].isStopped() {
		t.Fatal("count-triggered flush left the timer armed")
	}

	if err := w.Write(trainRec(500)); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if n := countLines(t, path); n != 2+flushEvery {
		t.Fatalf("%d lines after Flush, want %d", n, 2+flushEvery)
	}
	if !clk.last().isStopped() {
		t.Fatal("Flush left the timer armed")
	}
}

// A timer that fired while a Flush held the lock must not clobber the timer a later Write
// armed, or Close would stop the wrong one and wait for the other.
func TestSupersededBackgroundFlush(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.jsonl")
	w, clk := newTestWriter(t, path, false)
	if err := w.Write(trainRec(1)); err != nil {
		t.Fatal(err)
	}
	first := clk.last()
	first.failStop() // it has fired; its callback waits for the lock
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(trainRec(2)); err != nil {
		t.Fatal(err)
	}
	second := clk.last()
	if second == first {
		t.Fatal("second Write did not arm a new timer")
	}
	first.fire() // the stale callback finally runs
	if n := countLines(t, path); n != 1 {
		t.Fatalf("stale callback flushed: %d lines, want 1", n)
	}
	done := make(chan error, 1)
	go func() { done <- w.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close hung waiting for a timer it should have stopped")
	}
	if !second.isStopped() {
		t.Fatal("Close did not stop the current timer")
	}
	if n := countLines(t, path); n != 2 {
		t.Fatalf("%d lines after Close, want 2", n)
	}
}

func TestCloseTwiceAndWriteAfterClose(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.jsonl")
	w, clk := newTestWriter(t, path, false)
	if err := w.Write(trainRec(1)); err != nil {
		t.Fatal(err)
	}
	// The timer fires just as Close runs: Close must wait for the callback, and the callback
	// must find the Writer closed and do nothing.
	tm := clk.last()
	tm.failStop()
	closed := make(chan error, 1)
	go func() { closed <- w.Close() }()
	tm.fire()
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if n := countLines(t, path); n != 1 {
		t.Fatalf("Close did not flush: %d lines", n)
	}
	if err := w.Write(trainRec(2)); !errors.Is(err, ErrClosed) {
		t.Fatalf("Write after Close: %v, want ErrClosed", err)
	}
	if err := w.Flush(); !errors.Is(err, ErrClosed) {
		t.Fatalf("Flush after Close: %v, want ErrClosed", err)
	}
}

// The production timer is real; Close must not leave it behind.
func TestCloseWithRealTimer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.jsonl")
	w, err := Create(path, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Write(trainRec(1)); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > flushInterval/2 {
		t.Fatalf("Close took %v: it waited for the timer instead of stopping it", d)
	}
	if n := countLines(t, path); n != 1 {
		t.Fatalf("%d lines, want 1", n)
	}
}

func TestCreateMakesParentsAndTruncates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "a", "b", "m.jsonl")
	for range 2 {
		w, _ := newTestWriter(t, path, false)
		if err := w.Write(trainRec(1)); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if n := countLines(t, path); n != 1 {
		t.Fatalf("a fresh run should truncate: %d lines", n)
	}
	if _, err := Create(filepath.Join(path, "under-a-file"), false); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("Create under a regular file: err = %v, want one naming the path", err)
	}
}

func TestResumeAfterKilledRun(t *testing.T) {
	for _, tail := range []string{
		`{"kind":"train","ti`,                          // short partial record
		`{"kind":"` + strings.Repeat("x", 3*tailChunk), // partial record longer than the read chunk
	} {
		path := filepath.Join(t.TempDir(), "m.jsonl")
		w, _ := newTestWriter(t, path, false)
		for i := int64(1); i <= 2; i++ {
			if err := w.Write(trainRec(i)); err != nil {
				t.Fatal(err)
			}
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteString(tail) // the kill
		f.Close()

		recs, err := ReadFile(path)
		if err != nil || len(recs) != 2 {
			t.Fatalf("reading a killed run's file: %d records, err %v; want 2, nil", len(recs), err)
		}

		w, _ = newTestWriter(t, path, true)
		if err := w.Write(trainRec(3)); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		recs, err = ReadFile(path)
		if err != nil {
			t.Fatalf("after resuming: %v", err)
		}
		if len(recs) != 3 || recs[2].Step != 3 {
			t.Fatalf("after resuming: %+v", recs)
		}
	}
}

func TestAppendToFileWithoutNewline(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.jsonl")
	if err := os.WriteFile(path, []byte(`{"kind":"tr`), 0o644); err != nil {
		t.Fatal(err)
	}
	w, _ := newTestWriter(t, path, true)
	if err := w.Write(trainRec(1)); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, err := ReadFile(path)
	if err != nil || len(recs) != 1 {
		t.Fatalf("%+v, %v", recs, err)
	}
}

func TestReadFileErrors(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name, content string
		wantRecs      int
		wantErr       string
	}{
		{"empty", "", 0, ""},
		{"blank lines", "\n" + `{"kind":"train","step":1}` + "\n\n", 1, ""},
		{"complete last line without newline", `{"kind":"train","step":1}` + "\n" + `{"kind":"eval","step":1}`, 2, ""},
		{"malformed middle line", `{"kind":"train","step":1}` + "\nnot json\n" + `{"kind":"train","step":2}` + "\n", 0, "line 2"},
		{"malformed last line with newline", `{"kind":"train","step":1}` + "\n" + `{"kind":` + "\n", 0, "line 2"},
		{"wrong type", `{"kind":"train","step":"one"}` + "\n", 0, "line 1"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(c.name, " ", "_"))
			if err := os.WriteFile(path, []byte(c.content), 0o644); err != nil {
				t.Fatal(err)
			}
			recs, err := ReadFile(path)
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) || !strings.Contains(err.Error(), path) {
					t.Fatalf("err = %v, want one naming %q and the file", err, c.wantErr)
				}
				return
			}
			if err != nil || len(recs) != c.wantRecs {
				t.Fatalf("got %d records, err %v; want %d", len(recs), err, c.wantRecs)
			}
		})
	}
	if _, err := ReadFile(filepath.Join(dir, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
}

func TestConcurrentWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m.jsonl")
	w, clk := newTestWriter(t, path, false)
	const writers, each = 4, 250
	var wg sync.WaitGroup
	for g := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				if err := w.Write(trainRec(int64(g*each + i))); err != nil {
					t.Error(err)
					return
				}
				if i%50 == 0 {
					if tm := clk.last(); tm != nil {
						// Firing from another goroutine exercises the callback against Writes.
						tm.fire()
					}
				}
			}
		}()
	}
	wg.Wait()
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	recs, err := ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != writers*each {
		t.Fatalf("%d records, want %d", len(recs), writers*each)
	}
}

func TestWriteCSV(t *testing.T) {
	recs := []Record{
		{Kind: KindTrain, Time: 1700000000.5, Step: 1, Epoch: 0.01, Loss: 2.5, LR: 1e-3, Scale: 65536, GradNorm: 1.25, SamplesPerSec: 1800, HeapBytes: 1 << 20, RSSBytes: 2 << 20,
			AvailableBytes: 3 << 20, MaxHeapBytes: 4 << 20, LiveHeapBytes: 5 << 20, SwapInRate: 0.5, SwapOutRate: 12,
			Memory:    map[string]int64{"host_optimizer": 8192, "device_params": 4096},
			PhaseHeap: map[string]int64{"optimizer": 300, "forward+backward": 500},
			GPU:       map[string]int64{"gpu0_used": 7, "gpu0_total": 9}},
		{Kind: KindTrain, Time: 1700000001, Step: 2, Epoch: 0.02, Loss: math.NaN(), Skipped: true},
		{Kind: KindEval, Time: 1700000002, Step: 2, Epoch: 1, Loss: 0.5, Accuracy: 0.9, Samples: 10000},
		{Kind: KindEvent, Time: 1700000003, Step: 2, Event: EventRendezvous, Detail: "2 ranks", Gen: 5, World: 2},
		{Kind: KindMembers, Time: 1700000004, Step: 2, Members: []Member{{Name: "n0", State: "alive", Rank: 0, Step: 2, Gen: 9}}},
		{Kind: KindEvent, Time: 1700000005, Step: 3, Event: EventReform, Detail: "rank 2 lost", Gen: 6, World: 2, OldWorld: 3, Source: SourceMemory, LostSteps: 1, ResumeSeconds: 0.25},
	}
	var buf bytes.Buffer
	if err := WriteCSV(&buf, recs); err != nil {
		t.Fatal(err)
	}
	rows, err := csv.NewReader(&buf).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	want := [][]string{
		{"kind", "time", "step", "epoch", "loss", "lr", "scale", "grad_norm", "samples_per_sec", "skipped", "heap_bytes", "rss_bytes",
			"available_bytes", "max_heap_bytes", "live_heap_bytes", "swap_in_rate", "swap_out_rate", "phase_seconds", "memory", "phase_heap", "gpu", "accuracy", "samples",
			"oom_skipped", "event", "detail", "gen", "world", "members",
			"old_world", "source", "lost_steps", "resume_seconds"},
		{"train", "1700000000.5", "1", "0.01", "2.5", "0.001", "65536", "1.25", "1800", "false", "1048576", "2097152",
			"3145728", "4194304", "5242880", "0.5", "12", "", "device_params=4096 host_optimizer=8192", "forward+backward=500 optimizer=300", "gpu0_total=9 gpu0_used=7", "", "", "", "", "", "", "", "", "", "", "", ""},
		{"train", "1700000001", "2", "0.02", "NaN", "", "", "", "", "true", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", "", ""},
		{"eval", "1700000002", "2", "1", "0.5", "", "", "", "", "false", "", "", "", "", "", "", "", "", "", "", "", "0.9", "10000", "", "", "", "", "", "", "", "", "", ""},
		{"event", "1700000003", "2", "0", "0", "", "", "", "", "false", "", "", "", "", "", "", "", "", "", "", "", "", "",
			"", "rendezvous", "2 ranks", "5", "2", "", "", "", "", ""},
		{"members", "1700000004", "2", "0", "0", "", "", "", "", "false", "", "", "", "", "", "", "", "", "", "", "", "", "",
			"", "", "", "", "", `[{"name":"n0","state":"alive","rank":0,"step":2,"gen":"9"}]`, "", "", "", ""},
		{"event", "1700000005", "3", "0", "0", "", "", "", "", "false", "", "", "", "", "", "", "", "", "", "", "", "", "",
			"", "reform", "rank 2 lost", "6", "2", "", "3", "memory", "1", "0.25"},
	}
	if !reflect.DeepEqual(rows, want) {
		t.Fatalf("CSV:\n got %q\nwant %q", rows, want)
	}
}

type failingWriter struct{}

func (failingWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestWriteCSVError(t *testing.T) {
	err := WriteCSV(failingWriter{}, []Record{trainRec(1)})
	if err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("err = %v", err)
	}
}
