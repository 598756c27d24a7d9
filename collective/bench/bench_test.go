package bench

import (
	"bytes"
	"context"
	"io"
	"math"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
)

// benchInproc runs spec on n ranks over the in-process transport and returns rank 0's
// table and the wrong elements each rank counted.
func benchInproc(t *testing.T, n int, spec Spec, sizes []int64) (string, []int64) {
	t.Helper()
	_, ts := collective.NewInproc(n, 1)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out bytes.Buffer
	wrong := make([]int64, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		ring, err := collective.NewRing(ts[r], collective.Config{Transport: "inproc", Timeout: 10 * time.Second, ChunkBytes: 4096})
		if err != nil {
			t.Fatal(err)
		}
		defer ts[r].Close()
		defer ring.Close()
		w := io.Discard
		if r == 0 {
			w = &out
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			wrong[r], errs[r] = Run(ctx, ring, spec, sizes, w)
		}()
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
	}
	return out.String(), wrong
}

// benchRows returns the data lines of a table, split into fields, failing the test when the
// table is malformed (see ParseTable).
func benchRows(t *testing.T, table string) [][]string {
	t.Helper()
	rows, err := ParseTable(table)
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

func num(t *testing.T, s string) float64 {
	t.Helper()
	v, err := strconv.ParseFloat(s, 64)
	if err != nil {
		t.Fatalf("column %q: %v", s, err)
	}
	return v
}

// TestBenchCollectives runs each collective ZeRO uses at 2 and 3 ranks, on each wire type,
// with sizes that do and do not divide among the ranks (12 bytes: one to three elements each): every element of every result is
// right (#wrong 0), and the columns follow nccl-tests (size, count per rank for reduce-scatter
// and all-gather, redop, root, busbw = algbw × the collective's factor).
func TestBenchCollectives(t *testing.T) {
	sizes := []int64{12, 4100, 64 << 10}
	for _, name := range []string{"allreduce", "reducescatter", "allgather", "broadcast"} {
		coll := Collectives[name]
		for _, n := range []int{2, 3} {
			for _, wire := range []half.Format{half.FP32, half.FP16, half.BF16} {
				t.Run(name+"/"+strconv.Itoa(n)+"/"+wire.String(), func(t *testing.T) {
					spec := Spec{Coll: coll, Wire: wire, Root: n - 1, Iters: 2, Warmup: 1}
					table, wrong := benchInproc(t, n, spec, sizes)
					for r, w := range wrong {
						if w != 0 {
							t.Errorf("rank %d counted %d wrong", r, w)
						}
					}
					rows := benchRows(t, table)
					if len(rows) != len(sizes) {
						t.Fatalf("%d rows for %d sizes:\n%s", len(rows), len(sizes), table)
					}
					for i, f := range rows {
						elt := int64(wire.Bytes())
						count := sizes[i] / elt
						if coll.perRank {
							count /= int64(n)
						}
						bytes := count * elt
						if coll.perRank {
							bytes *= int64(n)
						}
						wantType := map[half.Format]string{half.FP32: "float", half.FP16: "half", half.BF16: "bfloat16"}[wire]
						wantRedop, wantRoot := "none", "-1"
						if coll.redop {
							wantRedop = "sum"
						}
						if coll.rooted {
							wantRoot = strconv.Itoa(n - 1)
						}
						if got := []string{f[0], f[1], f[2], f[3], f[4]}; strings.Join(got, " ") !=
							strings.Join([]string{strconv.FormatInt(bytes, 10), strconv.FormatInt(count, 10), wantType, wantRedop, wantRoot}, " ") {
							t.Errorf("size %d: columns %v, want %d %d %s %s %s", sizes[i], got, bytes, count, wantType, wantRedop, wantRoot)
						}
						for _, at := range []int{5, 9} { // out of place, in place
							tm, alg, bus, wr := num(t, f[at]), num(t, f[at+1]), num(t, f[at+2]), f[at+3]
							if wr != "0" {
								t.Errorf("size %d: #wrong %s", sizes[i], wr)
							}
							if tm <= 0 || math.Abs(alg-float64(bytes)/tm/1e3) > 0.0006+0.01*alg { // time to 0.01 us, GB/s to 0.001
								t.Errorf("size %d: algbw %v GB/s for %d bytes in %v us", sizes[i], alg, bytes, tm)
							}
							if want := alg * coll.busFactor(float64(n)); math.Abs(bus-want) > 0.0015 {
								t.Errorf("size %d: busbw %v, want %v × %v", sizes[i], bus, alg, coll.busFactor(float64(n)))
							}
						}
					}
					if !strings.Contains(table, "# Out of bounds values : 0 OK") {
						t.Errorf("no clean verdict in\n%s", table)
					}
				})
			}
		}
	}
}

// TestBenchCountsWrongResults corrupts one element of one rank's checked result: the table
// and the return value count exactly it, in each mode of each size.
func TestBenchCountsWrongResults(t *testing.T) {
	for _, name := range []string{"allreduce", "reducescatter", "allgather", "broadcast"} {
		t.Run(name, func(t *testing.T) {
			spec := Spec{Coll: Collectives[name], Wire: half.FP32, Iters: 1, Warmup: 0}
			spec.corrupt = func(rank int, out []float32) {
				if rank == 1 {
					out[len(out)-1] += 1 // in rank 1's shard of a reduce-scatter too
				}
			}
			sizes := []int64{4096, 8192}
			table, wrong := benchInproc(t, 2, spec, sizes)
			if wrong[0] != 4 || wrong[1] != 4 {
				t.Errorf("ranks counted %v wrong, want 4 each (one per mode and size)", wrong)
			}
			for _, f := range benchRows(t, table) {
				if f[8] != "1" || f[12] != "1" {
					t.Errorf("row %v: #wrong %s and %s, want 1 and 1", f, f[8], f[12])
				}
			}
			if !strings.Contains(table, "# Out of bounds values : 4 FAILED") {
				t.Errorf("no failed verdict in\n%s", table)
			}
		})
	}
}

// TestBenchUnwrittenCounted: a collective that leaves an element as it was (here, one a
// rank resets to the poison value) is counted, so the check does not pass a no-op.
func TestBenchUnwrittenCounted(t *testing.T) {
	spec := Spec{Coll: Collectives["allgather"], Wire: half.FP32, Iters: 1}
	spec.corrupt = func(rank int, out []float32) { out[0] = poison }
	_, wrong := benchInproc(t, 2, spec, []int64{64})
	if wrong[0] != 4 {
		t.Errorf("counted %d wrong, want 4 (two ranks, two modes)", wrong[0])
	}
}

func TestParseSizes(t *testing.T) {
	got, err := ParseSizes("64MiB, 1GiB,512M,4k,1024,1MB,6")
	want := []int64{64 << 20, 1 << 30, 512 << 20, 4 << 10, 1024, 1e6, 4}
	if err != nil || len(got) != len(want) {
		t.Fatalf("ParseSizes = %v, %v; want %v", got, err, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("size %d = %d, want %d", i, got[i], want[i])
		}
	}
	for _, bad := range []string{"", "1MiB,", "5GiB", "2", "lots"} {
		if _, err := ParseSizes(bad); err == nil {
			t.Errorf("ParseSizes(%q) accepted", bad)
		}
	}
}
