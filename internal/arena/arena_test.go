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

// TestTailNotRounded checks that a block a little over a huge page costs its size in RSS:
// the length is not rounded up to 2 MiB, so the tail is backed by base pages rather than by
// a huge page mostly unused (the difference was ~7 MiB per rank on bench/mlp-37m.yaml).
func TestTailNotRounded(t *testing.T) {
	n := hugePage + 2*pageSize
	b, err := Alloc(n, Buffers)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	mem := b.Bytes()
	for i := range mem {
		mem[i] = 1
	}
	smaps, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Skip("no /proc/self/smaps")
	}
	var size, rss int64 = -1, -1
	in := false
	for _, l := range strings.Split(string(smaps), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		if lo, hi, ok := strings.Cut(f[0], "-"); ok && len(f) >= 5 {
			a, err1 := strconv.ParseUint(lo, 16, 64)
			z, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && uint64(b.Addr()) >= a && uint64(b.Addr()) < z
			continue
		}
		if in && f[0] == "Size:" {
			size, _ = strconv.ParseInt(f[1], 10, 64)
		}
		if in && f[0] == "Rss:" {
			rss, _ = strconv.ParseInt(f[1], 10, 64)
		}
	}
	if size < 0 || rss < 0 {
		t.Fatalf("the block at %#x is not in /proc/self/smaps", b.Addr())
	}
	if b.size != uintptr(n) {
		t.Fatalf("a block of %d bytes maps %d", n, b.size)
	}
	// The kernel may merge the block's VMA with a neighbour of the same flags; where it has
	// not, the VMA is the block, and all of it is resident, no more.
	want := int64(n) >> 10
	if rss < want {
		t.Fatalf("%d KiB resident for a fully touched %d KiB block", rss, want)
	}
	if size == want && rss > want {
		t.Fatalf("%d KiB resident for a %d KiB block", rss, want)
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
