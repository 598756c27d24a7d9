package nccl

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
)

// reduceMax is what the all-reduce (max) of the ranks' agreeBufs leaves on every rank.
func reduceMax(ds ...desc) []uint64 {
	out := make([]uint64, 2*descWords)
	buf := make([]uint64, 2*descWords)
	for _, d := range ds {
		d.agreeBuf(buf)
		for i := range out {
			out[i] = max(out[i], buf[i])
		}
	}
	return out
}

func TestAgreementOfCallDescriptions(t *testing.T) {
	shards := collective.EvenShards(1000, 3)
	base := desc{kind: kindReduceScatter, tag: collective.MaxUserTag + 4, n: 1000, elem: uint64(half.BF16), op: collective.Avg, shards: shardsHash(shards)}
	if err := base.disagreement(reduceMax(base, base, base)); err != nil {
		t.Fatalf("identical calls: %v", err)
	}
	other := base
	other.n, other.kind, other.elem = 1001, kindAllReduce, uint64(half.FP16)
	other.shards = shardsHash(collective.Shards{0, 0, 0, 1001})
	for _, d := range []desc{base, other} {
		err := d.disagreement(reduceMax(base, base, other))
		if !errors.Is(err, collective.ErrProtocol) {
			t.Fatalf("rank with %v: %v", d.kind, err)
		}
		for _, want := range []string{"collective all-reduce..reduce-scatter", "length 1000..1001", "element type fp16..bf16", "shards"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%q does not say %q", err, want)
			}
		}
	}
	// A rank whose call failed validation makes everyone fail it.
	bad := desc{kind: kindInvalid, tag: base.tag, n: 1000}
	if err := base.disagreement(reduceMax(base, bad)); err == nil || !strings.Contains(err.Error(), "invalid call") {
		t.Errorf("invalid on one rank: %v", err)
	}
	// Concurrent tagged calls that reach NCCL in different orders are caught by the tag.
	t7, t9 := base, base
	t7.tag, t9.tag = 7, 9
	if err := t7.disagreement(reduceMax(t7, t9)); err == nil || !strings.Contains(err.Error(), "tag 7..9") {
		t.Errorf("different tags: %v", err)
	}
	// Host fp16 and device fp16 are different calls.
	dev := base
	dev.elem = elemDevice | uint64(half.BF16)
	if err := base.disagreement(reduceMax(base, dev)); err == nil || !strings.Contains(err.Error(), "bf16..device bf16") {
		t.Errorf("host and device: %v", err)
	}
}

func TestShardsHashTellsPartitionsApart(t *testing.T) {
	seen := map[uint64]collective.Shards{}
	for _, s := range []collective.Shards{
		{0, 10}, {0, 5, 10}, {0, 4, 10}, {0, 0, 10}, {0, 10, 10}, {0, 3, 6, 10}, {0, 1 << 40, 1<<40 + 1},
	} {
		h := shardsHash(s)
		if h == 0 {
			t.Errorf("%v hashes to 0, which means no shards", s)
		}
		if prev, ok := seen[h]; ok {
			t.Errorf("%v and %v hash alike", s, prev)
		}
		seen[h] = s
	}
	if maxShard(collective.Shards{0, 3, 3, 10}) != 7 || maxShard(collective.Shards{0, 0}) != 0 {
		t.Error("maxShard")
	}
}

// alignedBytes is n bytes aligned for float32s, as pinned memory is.
func alignedBytes(n int) []byte {
	w := make([]uint64, (n+7)/8+1)
	return unsafe.Slice((*byte)(unsafe.Pointer(&w[0])), n)
}

func TestWireRoundTrip(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	src := make([]float32, 1001)
	for i := range src {
		src[i] = float32(rng.NormFloat64() * 100)
	}
	src[0], src[1], src[2] = float32(math.Inf(1)), float32(math.NaN()), -0
	for _, w := range []half.Format{half.FP32, half.FP16, half.BF16} {
		b := alignedBytes(len(src) * w.Bytes())
		encodeWire(b, src, w)
		got := make([]float32, len(src))
		decodeWire(got, b, w)
		for i := range src {
			want := w.Round(src[i])
			if math.Float32bits(got[i]) != math.Float32bits(want) && !(math.IsNaN(float64(got[i])) && math.IsNaN(float64(want))) {
				t.Fatalf("%v element %d: %v → %v, want %v", w, i, src[i], got[i], want)
			}
		}
	}
}

// finishAvg is the ring's average: the fp32 sum divided in float32, rounded to the wire.
func TestFinishAvg(t *testing.T) {
	for _, w := range []half.Format{half.FP32, half.FP16, half.BF16} {
		x := []float32{3, 10, -7, 1e-3, 65504 * 2}
		want := make([]float32, len(x))
		for i, v := range x {
			want[i] = w.Round(v / 3)
		}
		finishAvg(x, 3, w)
		for i := range x {
			if x[i] != want[i] {
				t.Errorf("%v: element %d = %v, want %v", w, i, x[i], want[i])
			}
		}
	}
	x := []float32{1.0000001}
	finishAvg(x, 1, half.BF16)
	if x[0] != 1.0000001 {
		t.Errorf("a group of one must leave data untouched: %v", x[0])
	}
}

func TestExchangeIDIsExactForEveryByte(t *testing.T) {
	var id uniqueID
	for i := range id.Internal {
		id.Internal[i] = byte(255 - i) // 0xff 0xfe ... would be NaN payloads as raw float32 bits
	}
	id.Internal[0], id.Internal[1] = 0xff, 0xff
	for r, x := range exchangeAll(t, 3, func(int) error { return nil }, func() (uniqueID, error) { return id, nil }) {
		if x.err != nil || x.id != id || x.version != 22000 {
			t.Errorf("rank %d: %v, version %d, id right %v", r, x.err, x.version, x.id == id)
		}
	}
}

// inprocGroup is a group of rings over the in-process transport: the bootstrap of the tests.
func inprocGroup(t *testing.T, size int) []collective.Communicator {
	t.Helper()
	_, ts := collective.NewInproc(size, 1)
	comms := make([]collective.Communicator, size)
	for r := range size {
		ring, err := collective.NewRing(ts[r], collective.Config{Transport: "inproc", Timeout: 5 * time.Second, ChunkBytes: 16 << 10})
		if err != nil {
			t.Fatal(err)
		}
		comms[r] = ring
	}
	t.Cleanup(func() {
		for r := range size {
			comms[r].Close()
			ts[r].Close()
		}
	})
	return comms
}

type exchangeResult struct {
	id      uniqueID
	version int
	err     error
}

func exchangeAll(t *testing.T, size int, local func(r int) error, newID func() (uniqueID, error)) []exchangeResult {
	boot := inprocGroup(t, size)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	out := make([]exchangeResult, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id, v, err := exchangeID(ctx, boot[r], local(r), newID, 22000+r)
			out[r] = exchangeResult{id, v, err}
		}()
	}
	wg.Wait()
	return out
}

func TestExchangeIDGivesEveryRankRankZerosID(t *testing.T) {
	var want uniqueID
	for i := range want.Internal {
		want.Internal[i] = byte(i*37 + 11)
	}
	calls := 0
	res := exchangeAll(t, 3, func(int) error { return nil }, func() (uniqueID, error) { calls++; return want, nil })
	if calls != 1 {
		t.Errorf("ncclGetUniqueId called %d times", calls)
	}
	for r, x := range res {
		if x.err != nil || x.id != want || x.version != 22000 {
			t.Errorf("rank %d: %v, version %d, id right %v", r, x.err, x.version, x.id == want)
		}
	}
}

func TestExchangeIDFailsEveryRankWhenOneCannotStart(t *testing.T) {
	noGPU := errors.New("nccl: rank 2 wants GPU 2, but this machine has 1")
	res := exchangeAll(t, 4, func(r int) error {
		if r == 2 {
			return noGPU
		}
		return nil
	}, func() (uniqueID, error) { return uniqueID{}, nil })
	for r, x := range res {
		switch {
		case r == 2 && !errors.Is(x.err, noGPU):
			t.Errorf("rank 2: %v, want its own error", x.err)
		case r != 2 && (x.err == nil || !strings.Contains(x.err.Error(), "rank 2 could not start NCCL")):
			t.Errorf("rank %d: %v, want one naming rank 2", r, x.err)
		}
	}
	// Rank 0 failing to make the id counts as rank 0 failing.
	res = exchangeAll(t, 2, func(int) error { return nil }, func() (uniqueID, error) {
		return uniqueID{}, errors.New("ncclGetUniqueId: ncclSystemError")
	})
	if res[0].err == nil || res[1].err == nil || !strings.Contains(res[1].err.Error(), "rank 0 could not start") {
		t.Errorf("results %v / %v", res[0].err, res[1].err)
	}
}

func TestPollNamesTheDeadline(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	polls := 0
	err := poll(ctx, func() (bool, error) { polls++; return false, nil })
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "deadline") {
		t.Fatalf("err = %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("poll took %v past a 30ms deadline", d)
	}
	if polls < 10 {
		t.Errorf("only %d polls in 30ms", polls)
	}
	cctx, ccancel := context.WithCancel(context.Background())
	ccancel()
	if err := poll(cctx, func() (bool, error) { return false, nil }); !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "cancelled") {
		t.Errorf("cancelled: %v", err)
	}
	boom := errors.New("boom")
	if err := poll(context.Background(), func() (bool, error) { return false, boom }); err != boom {
		t.Errorf("step error: %v", err)
	}
	n := 0
	if err := poll(context.Background(), func() (bool, error) { n++; return n == 250, nil }); err != nil || n != 250 {
		t.Errorf("done after %d: %v", n, err)
	}
}

// A context without a deadline still gets one, the communicator's timeout, named as such.
func TestBoundedNamesTheTimeout(t *testing.T) {
	ctx, cancel := bounded(context.Background(), 20*time.Millisecond)
	defer cancel()
	err := poll(ctx, func() (bool, error) { return false, nil })
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, collective.ErrTimeout) ||
		!strings.Contains(err.Error(), "timeout of 20ms") || !strings.Contains(err.Error(), "deadline") {
		t.Fatalf("err = %v", err)
	}
	if ctx, cancel := bounded(context.Background(), 0); ctx != context.Background() {
		t.Error("a zero timeout must leave the context alone")
	} else {
		cancel()
	}
}

func TestValidate(t *testing.T) {
	ok := collective.Call{Wire: half.BF16}
	for _, c := range []struct {
		err  error
		want string
	}{
		{validate(kindAllReduce, 10, 2, nil, collective.Sum, 0, collective.Call{Tag: collective.MaxUserTag}), "MaxUserTag"},
		{validate(kindAllReduce, 10, 2, nil, collective.Sum, 0, collective.Call{Wire: 9}), "wire type"},
		{validate(kindReduceScatter, 10, 2, nil, collective.Op(9), 0, ok), "unknown reduction"},
		{validate(kindBroadcast, 10, 2, nil, collective.Sum, 2, ok), "root 2"},
		{validate(kindAllGather, 10, 2, collective.Shards{0, 10}, collective.Sum, 0, ok), "shard bounds"},
	} {
		if c.err == nil || !strings.Contains(c.err.Error(), c.want) {
			t.Errorf("%v, want an error saying %q", c.err, c.want)
		}
	}
	if err := validate(kindReduceScatter, 10, 2, collective.Shards{0, 0, 10}, collective.Max, 0, ok); err != nil {
		t.Error(err)
	}
	if fmt.Sprint(dataType(half.BF16), dataType(half.FP16), dataType(half.FP32)) != "9 6 7" {
		t.Error("data types")
	}
	if redOp(collective.Avg, true) != ncclSum || redOp(collective.Avg, false) != ncclAvg || redOp(collective.Max, true) != ncclMax {
		t.Error("reductions")
	}
}
