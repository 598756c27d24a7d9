package zero

import (
	"fmt"
	"testing"
)

func TestLayoutPartitions(t *testing.T) {
	cases := []struct {
		size, world int
	}{
		{0, 1}, {0, 4}, {1, 1}, {1, 3}, {15, 2}, {16, 2}, {17, 2}, {100, 3}, {235152, 4},
		{235146, 3}, // the MLP's flat size is aligned, but not every size is
		{48, 8},     // more ranks than aligned blocks: some shards empty
		{1 << 20, 7},
		{5, 1},   // a single tiny tensor
		{1e7, 2}, // a single huge tensor
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%d/%d", c.size, c.world), func(t *testing.T) {
			l, err := NewLayout(c.size, c.world)
			if err != nil {
				t.Fatal(err)
			}
			if err := l.Shards.Validate(c.size, c.world); err != nil {
				t.Fatal(err)
			}
			blocks := (c.size + ShardAlign - 1) / ShardAlign
			for r := 0; r < c.world; r++ {
				lo, hi := l.Shard(r)
				if lo%ShardAlign != 0 || (hi%ShardAlign != 0 && hi != c.size) {
					t.Fatalf("rank %d shard [%d, %d) not aligned to %d", r, lo, hi, ShardAlign)
				}
				// Balanced to within one aligned block.
				want := blocks / c.world * ShardAlign
				if n := hi - lo; n > want+ShardAlign || (n < want-ShardAlign && hi != c.size) {
					t.Fatalf("rank %d shard of %d elements, expected about %d", r, n, want)
				}
			}
		})
	}
	if _, err := NewLayout(10, 0); err == nil {
		t.Fatal("world 0 accepted")
	}
	if _, err := NewLayout(-1, 2); err == nil {
		t.Fatal("negative size accepted")
	}
}

func TestBucketsRespectShards(t *testing.T) {
	for _, c := range []struct{ size, world, bucket int }{
		{100, 3, 7}, {235152, 4, 1 << 14}, {48, 8, 5}, {1000, 2, 5000}, {33, 2, 1},
	} {
		l, _ := NewLayout(c.size, c.world)
		bs, err := l.Buckets(c.bucket)
		if err != nil {
			t.Fatal(err)
		}
		covered := make([]int, c.world) // elements each rank owns across buckets
		next := 0
		for _, b := range bs {
			if b.Lo != next || b.Hi <= b.Lo || b.Hi-b.Lo > c.bucket {
				t.Fatalf("%+v: bucket [%d, %d) after %d", c, b.Lo, b.Hi, next)
			}
			next = b.Hi
			if err := b.Shards.Validate(b.Hi-b.Lo, c.world); err != nil {
				t.Fatal(err)
			}
			for r := 0; r < c.world; r++ {
				lo, hi := b.Lo+b.Shards[r], b.Lo+b.Shards[r+1]
				slo, shi := l.Shard(r)
				if lo < hi && (lo < slo || hi > shi) {
					t.Fatalf("bucket part of rank %d [%d, %d) outside its shard [%d, %d)", r, lo, hi, slo, shi)
				}
				covered[r] += hi - lo
			}
		}
		if next != c.size {
			t.Fatalf("%+v: buckets end at %d", c, next)
		}
		for r := 0; r < c.world; r++ {
			if covered[r] != l.Len(r) {
				t.Fatalf("%+v: rank %d gets %d elements from buckets, owns %d", c, r, covered[r], l.Len(r))
			}
		}
	}
	l, _ := NewLayout(10, 2)
	if _, err := l.Buckets(0); err == nil {
		t.Fatal("bucket size 0 accepted")
	}
}

func TestOverlap(t *testing.T) {
	if lo, hi, ok := Overlap(0, 10, 5, 20); !ok || lo != 5 || hi != 10 {
		t.Fatal(lo, hi, ok)
	}
	if _, _, ok := Overlap(0, 5, 5, 10); ok {
		t.Fatal("touching ranges overlap")
	}
}
