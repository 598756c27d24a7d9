package arena

import (
	"os"
	"strconv"
	"strings"
	"testing"
)

func TestAllocFreeAccounting(t *testing.T) {
	before := Snapshot()
	small, err := Alloc(100, Grads)
	if err != nil {
		t.Fatal(err)
	}
	big, xs, err := Float32s(3<<20, Optimizer) // 12 MiB: huge-page aligned
	if err != nil {
		t.Fatal(err)
	}
	if len(small.Bytes()) != 100 || len(xs) != 3<<20 {
		t.Fatalf("lengths %d, %d", len(small.Bytes()), len(xs))
	}
	if big.Addr()%hugePage != 0 {
		t.Fatalf("a 12 MiB block at %#x is not 2 MiB-aligned", big.Addr())
	}
	for i, v := range xs {
		if v != 0 {
			t.Fatalf("xs[%d] = %v: not zeroed", i, v)
		}
	}
	xs[len(xs)-1] = 1 // the whole range is writable
	s := Snapshot()
	if got := s.Current[Grads] - before.Current[Grads]; got != 100 {
		t.Fatalf("grads: %d bytes accounted, want 100", got)
	}
	if got := s.Current[Optimizer] - before.Current[Optimizer]; got != 12<<20 {
		t.Fatalf("optimizer: %d bytes accounted, want %d", got, 12<<20)
	}
	small.Free()
	big.Free()
	big.Free() // twice is safe
	after := Snapshot()
	if after.Total != before.Total || after.Live != before.Live {
		t.Fatalf("after Free: total %d live %d, before %d %d", after.Total, after.Live, before.Total, before.Live)
	}
	if after.Peak[Optimizer] < 12<<20 {
		t.Fatalf("peak %d lost", after.Peak[Optimizer])
	}
}

// TestOutsideHeap checks what the package is for: the mapping is not Go heap, and it is
// returned to the kernel on Free (the process's RSS drops by about its size).
func TestOutsideHeap(t *testing.T) {
	rss := func() int64 {
		b, err := os.ReadFile("/proc/self/status")
		if err != nil {
			t.Skip("no /proc/self/status")
		}
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "VmRSS:") {
				f := strings.Fields(l)
				n, _ := strconv.ParseInt(f[1], 10, 64)
				return n << 10
			}
		}
		t.Skip("no VmRSS")
		return 0
	}
	const n = 64 << 20
	r0 := rss()
	b, err := Alloc(n, Buffers)
	if err != nil {
		t.Fatal(err)
	}
	mem := b.Bytes()
	for i := 0; i < len(mem); i += 4096 {
		mem[i] = 1
	}
	r1 := rss()
	b.Free()
	r2 := rss()
	if r1-r0 < n*9/10 {
		t.Fatalf("touching %d bytes raised RSS by %d", n, r1-r0)
	}
	if r1-r2 < n*9/10 {
		t.Fatalf("Free gave back %d of %d bytes", r1-r2, n)
	}
}

func TestBadArgs(t *testing.T) {
	if _, err := Alloc(0, Grads); err == nil {
		t.Fatal("Alloc(0) succeeded")
	}
	if _, err := Alloc(10, Category(200)); err == nil {
		t.Fatal("unknown category accepted")
	}
	if b, xs, err := Float32s(0, Grads); b != nil || xs != nil || err != nil {
		t.Fatal("Float32s(0) should be empty")
	}
}
