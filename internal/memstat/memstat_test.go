package memstat

import (
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// fakeProc writes the given files under a temporary /proc stand-in.
func fakeProc(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for name, content := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

const meminfo = `MemTotal:       24682416 kB
MemFree:        21911008 kB
MemAvailable:   23985272 kB
Buffers:           82040 kB
`

func vmstat(in, out int, padding int) string {
	var b strings.Builder
	b.WriteString("nr_free_pages 5477752\npswpin_something_else 99\n")
	for i := 0; i < padding; i++ {
		b.WriteString("nr_padding_counter_for_a_long_file 123456789\n")
	}
	b.WriteString("pswpin " + itoa(in) + "\npswpout " + itoa(out) + "\npgfault 1\n")
	return b.String()
}

func itoa(n int) string { return strconv.Itoa(n) }

func TestReadFakeProc(t *testing.T) {
	for _, padding := range []int{0, 1000} { // 1000 lines ≈ 45 KiB: the buffer must grow
		root := fakeProc(t, map[string]string{
			"self/statm": "765 410 381 5 0 123 0\n",
			"meminfo":    meminfo,
			"vmstat":     vmstat(12, 34, padding),
		})
		r := newReaderAt(root)
		defer r.Close()
		s := r.Read()
		page := uint64(os.Getpagesize())
		if s.RSS != 410*page {
			t.Errorf("RSS = %d, want %d", s.RSS, 410*page)
		}
		if s.Available != 23985272*1024 || s.Total != 24682416*1024 {
			t.Errorf("Available, Total = %d, %d, want %d, %d", s.Available, s.Total, 23985272*1024, 24682416*1024)
		}
		if s.SwapInPages != 12 || s.SwapOutPages != 34 {
			t.Errorf("swap in/out = %d/%d, want 12/34", s.SwapInPages, s.SwapOutPages)
		}
		if s.HeapInUse == 0 || s.GoTotal < s.HeapInUse {
			t.Errorf("runtime figures: heap %d, total %d", s.HeapInUse, s.GoTotal)
		}

		// The files are kept open; new contents must still be seen.
		if err := os.WriteFile(filepath.Join(root, "vmstat"), []byte(vmstat(56, 78, padding)), 0o644); err != nil {
			t.Fatal(err)
		}
		if s := r.Read(); s.SwapInPages != 56 || s.SwapOutPages != 78 {
			t.Errorf("after rewrite: swap in/out = %d/%d, want 56/78", s.SwapInPages, s.SwapOutPages)
		}
	}
}

func TestMissingAndMalformedFiles(t *testing.T) {
	cases := map[string]map[string]string{
		"missing": {},
		"malformed": {
			"self/statm": "garbage\n",
			"meminfo":    "MemTotalX: 1 kB\nMemAvailableX: 5 kB\nMemAvailable: kB\nMemTotal: x kB\n",
			"vmstat":     "pswpin\npswpout x\n",
		},
		"empty":    {"self/statm": "", "meminfo": "", "vmstat": ""},
		"overflow": {"self/statm": "1 99999999999999999999999\n", "meminfo": "MemAvailable: 99999999999999999999999 kB\n"},
	}
	for name, files := range cases {
		t.Run(name, func(t *testing.T) {
			r := newReaderAt(fakeProc(t, files))
			defer r.Close()
			for range 2 { // the second Read takes the "failed before" path
				s := r.Read()
				if s.RSS != 0 || s.Available != 0 || s.Total != 0 || s.SwapInPages != 0 || s.SwapOutPages != 0 {
					t.Fatalf("want zeros for unreadable figures, got %+v", s)
				}
				if s.HeapInUse == 0 {
					t.Fatal("runtime figures must not depend on /proc")
				}
			}
		})
	}
}

func TestLookupMatchesWholeKey(t *testing.T) {
	b := []byte("pswpin_x 1\npswpinn 2\npswpin\t3\n")
	if v, ok := lookup(b, "pswpin"); !ok || v != 3 {
		t.Fatalf("lookup = %d, %v; want 3, true", v, ok)
	}
	if _, ok := lookup(b, "nope"); ok {
		t.Fatal("found a missing key")
	}
	if v, ok := nthField([]byte("  7   8 9"), 1); !ok || v != 8 {
		t.Fatalf("nthField = %d, %v", v, ok)
	}
	if _, ok := nthField([]byte("7\n8"), 1); ok {
		t.Fatal("nthField read past the first line")
	}
}

func TestReadLive(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("/proc figures are Linux only")
	}
	r := NewReader()
	defer r.Close()
	s := r.Read()
	if s.HeapInUse == 0 || s.GoTotal < s.HeapInUse || s.RSS == 0 || s.Available == 0 {
		t.Fatalf("implausible snapshot %+v", s)
	}
}

func TestReadDoesNotAllocate(t *testing.T) {
	for name, r := range map[string]*Reader{
		"live":  NewReader(),
		"grown": newReaderAt(fakeProc(t, map[string]string{"self/statm": "1 2\n", "meminfo": meminfo, "vmstat": vmstat(1, 2, 1000)})),
	} {
		r.Read() // opens the files and sizes the buffers
		if n := testing.AllocsPerRun(100, func() { r.Read() }); n != 0 {
			t.Errorf("%s: Read allocates %.1f times per call after the first", name, n)
		}
		r.Close()
	}
}

func TestCloseTwiceAndReadAfterClose(t *testing.T) {
	r := newReaderAt(fakeProc(t, map[string]string{"self/statm": "1 2\n", "meminfo": meminfo}))
	if s := r.Read(); s.RSS == 0 {
		t.Fatal("RSS not read")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	s := r.Read()
	if s.RSS != 0 || s.Available != 0 || s.HeapInUse == 0 {
		t.Fatalf("after Close: %+v", s)
	}
}

func TestConcurrentRead(t *testing.T) {
	r := NewReader()
	defer r.Close()
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				r.Read()
			}
		}()
	}
	wg.Wait()
}

func TestFormatBytes(t *testing.T) {
	for _, c := range []struct {
		n    uint64
		want string
	}{
		{0, "0 B"},
		{17, "17 B"},
		{1023, "1023 B"},
		{1024, "1.0 KiB"},
		{1536, "1.5 KiB"},
		{312 << 20, "312.0 MiB"},
		{3 << 29, "1.5 GiB"},
		{1<<20 - 1, "1.0 MiB"}, // rounds up across the unit boundary
		{5 << 40, "5.0 TiB"},
		{math.MaxUint64, "16.0 EiB"},
	} {
		if got := FormatBytes(c.n); got != c.want {
			t.Errorf("FormatBytes(%d) = %q, want %q", c.n, got, c.want)
		}
	}
}

func BenchmarkRead(b *testing.B) {
	r := NewReader()
	defer r.Close()
	b.ReportAllocs()
	for b.Loop() {
		r.Read()
	}
}
