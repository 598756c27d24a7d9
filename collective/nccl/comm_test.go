//go:build cuda

// These tests need a GPU and libnccl.so.2 (or $QVD_NCCL_LIBRARY), or the emulated driver and
// NCCL of internal/cudaemu, on which CI runs them (scripts/gpu/emulate.sh: groups of 1, 2 and
// 4 on four emulated devices, also under -race). NCCL refuses two ranks on one GPU, so rank r
// of a group runs on GPU r.

package nccl

import (
	"context"
	"errors"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
	"github.com/qvd/qvd/internal/half"
)

func gpus(t *testing.T) int {
	t.Helper()
	n, err := cu.NumDevices()
	if err != nil || n == 0 {
		t.Skipf("no GPU: %d devices, %v", n, err)
	}
	if _, err := loadLibrary(); err != nil {
		t.Skipf("no NCCL: %v", err)
	}
	return n
}

// ncclGroup makes the communicators of a group of size ranks, rank r on GPU r, bootstrapped
// over the in-process ring transport, and closes them when t ends.
func ncclGroup(t *testing.T, size int) []*Comm {
	t.Helper()
	boot := inprocGroup(t, size)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	comms := make([]*Comm, size)
	errs := make([]error, size)
	var wg sync.WaitGroup
	for r := range size {
		wg.Add(1)
		go func() {
			defer wg.Done()
			comms[r], errs[r] = New(ctx, boot[r], r)
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range comms {
			if c != nil {
				if err := c.Close(); err != nil {
					t.Errorf("close: %v", err)
				}
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return comms
}

func factory(t *testing.T, size int) ([]collective.Communicator, func(int)) {
	comms := ncclGroup(t, size)
	out := make([]collective.Communicator, size)
	for r, c := range comms {
		out[r] = c
	}
	return out, nil
}

// TestConformance runs the suite for a group of one, or for the sizes in
// $QVD_NCCL_TEST_SIZES ("1,2,4") on a machine with that many GPUs. In groups of more than one
// the Concurrent case is expected to fail: Comm serialises calls, and concurrent calls that
// reach NCCL in different orders on different ranks fail with collective.ErrProtocol (see the
// package documentation); skip it with -skip 'N=[2-9]/Concurrent'.
func TestConformance(t *testing.T) {
	n := gpus(t)
	sizes := []int{1}
	if env := os.Getenv("QVD_NCCL_TEST_SIZES"); env != "" {
		sizes = nil
		for _, f := range strings.Split(env, ",") {
			s, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || s < 1 || s > n {
				t.Fatalf("QVD_NCCL_TEST_SIZES=%q: %q is not a group size this machine's %d GPUs can make", env, f, n)
			}
			sizes = append(sizes, s)
		}
	}
	collectivetest.RunSizes(t, factory, sizes...)
}

// In a group of one the public calls run in fp32 (data untouched); keepWire runs the 16-bit
// staging path anyway, where every collective of one rank returns its input rounded.
func TestWireStagingInAGroupOfOne(t *testing.T) {
	gpus(t)
	c := ncclGroup(t, 1)[0]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rng := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{1, 1000, 3<<20/4 + 13} { // the last grows the staging buffers
		x := make([]float32, n)
		for i := range x {
			x[i] = float32(rng.NormFloat64() * 10)
		}
		for _, w := range []half.Format{half.FP32, half.FP16, half.BF16} {
			for _, k := range []kind{kindAllReduce, kindReduceScatter, kindAllGather, kindBroadcast} {
				for _, op := range []collective.Op{collective.Sum, collective.Avg, collective.Max} {
					if k != kindAllReduce && k != kindReduceScatter && op != collective.Sum {
						continue
					}
					buf := slices.Clone(x)
					var shards collective.Shards
					if k == kindReduceScatter || k == kindAllGather {
						shards = collective.Shards{0, n}
					}
					if err := c.host(ctx, k, buf, shards, op, 0, collective.Call{Wire: w}, true); err != nil {
						t.Fatalf("%v %v %v len %d: %v", k, w, op, n, err)
					}
					for i := range buf {
						if want := w.Round(x[i]); math.Float32bits(buf[i]) != math.Float32bits(want) {
							t.Fatalf("%v %v %v len %d: element %d = %v, want %v", k, w, op, n, i, buf[i], want)
						}
					}
				}
			}
		}
	}
}

func TestDeviceEntryPoints(t *testing.T) {
	gpus(t)
	c := ncclGroup(t, 1)[0]
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	leave, err := c.enter()
	if err != nil {
		t.Fatal(err)
	}
	defer leave()
	const n = 4097
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(i%97) - 48.5
	}
	p, err := cu.MemAlloc(n * 4)
	if err != nil {
		t.Fatal(err)
	}
	defer cu.MemFree(p)
	if err := cu.MemcpyHtoD(p, unsafe.Pointer(&x[0]), n*4); err != nil {
		t.Fatal(err)
	}
	shards := collective.Shards{0, n}
	for name, call := range map[string]func() error{
		"all-reduce sum":     func() error { return c.AllReduceDevice(ctx, uint64(p), n, half.FP32, collective.Sum) },
		"all-reduce avg":     func() error { return c.AllReduceDevice(ctx, uint64(p), n, half.FP32, collective.Avg) },
		"reduce-scatter max": func() error { return c.ReduceScatterDevice(ctx, uint64(p), shards, half.FP32, collective.Max) },
		"all-gather":         func() error { return c.AllGatherDevice(ctx, uint64(p), shards, half.FP32) },
		"broadcast":          func() error { return c.BroadcastDevice(ctx, uint64(p), n, half.FP32, 0) },
	} {
		if err := call(); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		got := make([]float32, n)
		if err := cu.MemcpyDtoH(unsafe.Pointer(&got[0]), p, n*4); err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, x) {
			t.Fatalf("%s changed the data of a group of one", name)
		}
	}
	if err := c.AllReduceDevice(ctx, 0, 5, half.FP32, collective.Sum); err == nil || !strings.Contains(err.Error(), "null") {
		t.Errorf("null pointer: %v", err)
	}
}

// A rank whose context has ended before the call fails it at once, naming the deadline, and
// the communicator still works (nothing was queued); after Close every call fails.
func TestExpiredContextAndClose(t *testing.T) {
	gpus(t)
	c := ncclGroup(t, 1)[0]
	ctx, cancel := context.WithTimeout(context.Background(), time.Nanosecond)
	defer cancel()
	<-ctx.Done()
	err := c.AllReduce(ctx, make([]float32, 10), collective.Sum, collective.Call{})
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "deadline") {
		t.Fatalf("expired: %v", err)
	}
	if err := c.Barrier(context.Background()); err != nil {
		t.Fatalf("barrier after an expired call: %v", err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second close: %v", err)
	}
	if err := c.AllReduce(context.Background(), make([]float32, 10), collective.Sum, collective.Call{}); !errors.Is(err, collective.ErrClosed) {
		t.Fatalf("after close: %v", err)
	}
}

// The point of the non-blocking communicator: rank 0 of a group of two whose rank 1 never
// comes waits in ncclCommInitRankConfig only until its deadline, then aborts.
func TestInitGivesUpAtTheDeadline(t *testing.T) {
	gpus(t)
	c := &Comm{rank: 0, size: 2, device: 0}
	if err := c.setup(); err != nil {
		t.Fatal(err)
	}
	defer c.release()
	id, err := c.newID()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	start := time.Now()
	err = c.initComm(ctx, id)
	took := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "deadline") || !strings.Contains(err.Error(), "aborted") {
		t.Fatalf("err = %v", err)
	}
	if took > 2*time.Second+drainTimeout {
		t.Fatalf("gave up after %v", took)
	}
	t.Logf("gave up after %v: %v", took, err)
}
