//go:build cuda

package nccl

// Tests that need the emulated driver and NCCL (internal/cudaemu; scripts/gpu/emulate.sh runs
// them with QVD_CUDAEMU_DEVICES=4): they skip elsewhere, since they pin down what the
// emulator does (its fixed summation order, its shared-memory segment) rather than what NCCL
// promises. The emulator reduces ranks 0, 1, … in order, rounding each partial result to the
// element type, and ncclAvg pre-multiplies by 1/n rounded to the type: so every result below
// is compared bit for bit with the same arithmetic done here.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/cudaemu"
	"github.com/qvd/qvd/internal/half"
)

// emulated skips the test unless the process runs on the emulated driver with NCCL loaded
// (which is then the emulated NCCL: NVIDIA's cannot run on the emulated driver) and at least
// size devices.
func emulated(t *testing.T, size int) {
	t.Helper()
	drv, err := cudaemu.Open()
	if errors.Is(err, cudaemu.ErrNotEmulated) {
		t.Skipf("not under the emulated driver: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	drv.Close()
	if n := gpus(t); n < size {
		t.Skipf("%d emulated devices, the test needs %d (QVD_CUDAEMU_DEVICES)", n, size)
	}
}

// onAll runs fn for every rank at once, each goroutine on its rank's context.
func onAll(t *testing.T, comms []*Comm, fn func(r int, c *Comm) error) {
	t.Helper()
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	for r, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			leave, err := c.enter()
			if err != nil {
				errs[r] = err
				return
			}
			defer leave()
			errs[r] = fn(r, c)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// devBuf is n elements of type w on the current context's device.
func devBuf(w half.Format, n int) (cu.DevicePtr, func(), error) {
	p, err := cu.MemAlloc(int64(max(n, 1) * w.Bytes()))
	if err != nil {
		return 0, nil, err
	}
	return p, func() { cu.MemFree(p) }, nil
}

func upload(p cu.DevicePtr, x []float32, w half.Format) error {
	b := make([]byte, len(x)*w.Bytes())
	encodeWire(b, x, w)
	if len(b) == 0 {
		return nil
	}
	return cu.MemcpyHtoD(p, unsafe.Pointer(&b[0]), int64(len(b)))
}

func download(x []float32, p cu.DevicePtr, w half.Format) error {
	b := make([]byte, len(x)*w.Bytes())
	if len(b) == 0 {
		return nil
	}
	if err := cu.MemcpyDtoH(unsafe.Pointer(&b[0]), p, int64(len(b))); err != nil {
		return err
	}
	decodeWire(x, b, w)
	return nil
}

// fixedOrder is the emulator's reduction of in[0..n) at element i, in type w.
func fixedOrder(in [][]float32, i int, w half.Format, op collective.Op) float32 {
	n := len(in)
	scale := w.Round(1 / float32(n))
	term := func(r int) float32 {
		if op == collective.Avg {
			return w.Round(in[r][i] * scale)
		}
		return in[r][i]
	}
	acc := term(0)
	for r := 1; r < n; r++ {
		x := term(r)
		switch op {
		case collective.Max:
			if acc < x {
				acc = x
			}
		default:
			acc = w.Round(acc + x)
		}
	}
	return acc
}

func randomInputs(seed uint64, size, n int, w half.Format) [][]float32 {
	rng := rand.New(rand.NewPCG(seed, uint64(size)))
	in := make([][]float32, size)
	for r := range in {
		in[r] = make([]float32, n)
		for i := range in[r] {
			in[r][i] = w.Round(float32(rng.NormFloat64() * 10))
		}
	}
	return in
}

func sameBits(what string, got []float32, want func(i int) float32) error {
	for i := range got {
		if w := want(i); math.Float32bits(got[i]) != math.Float32bits(w) {
			return fmt.Errorf("%s: element %d = %v (%#x), want %v (%#x)", what, i, got[i], math.Float32bits(got[i]), w, math.Float32bits(w))
		}
	}
	return nil
}

// TestEmuDeviceCollectives runs the device entry points (the GPU engine's path) at 2 and 4
// ranks, in every element type, with the default slots and with 1 KiB slots (every call in
// many chunks), uneven shards taking the padded scratch path: every rank's result must be the
// fixed-order reduction bit for bit, hence identical on every rank.
func TestEmuDeviceCollectives(t *testing.T) {
	for _, slot := range []string{"", "1"} {
		for _, size := range []int{2, 4} {
			t.Run(fmt.Sprintf("slot=%sKiB/N=%d", slot, size), func(t *testing.T) {
				emulated(t, size)
				t.Setenv("QVD_CUDAEMU_NCCL_SLOT_KIB", slot)
				comms := ncclGroup(t, size)
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				const n = 3001
				uneven := collective.Shards{0}
				for r := range size {
					uneven = append(uneven, uneven[r]+n/size+r) // the last absorbs the rest
				}
				uneven[size] = n
				for _, w := range []half.Format{half.FP32, half.FP16, half.BF16} {
					for _, op := range []collective.Op{collective.Sum, collective.Avg, collective.Max} {
						in := randomInputs(uint64(w)*10+uint64(op), size, n, w)
						what := fmt.Sprintf("all-reduce %v %v", w, op)
						onAll(t, comms, func(r int, c *Comm) error {
							p, free, err := devBuf(w, n)
							if err != nil {
								return err
							}
							defer free()
							if err := upload(p, in[r], w); err != nil {
								return err
							}
							if err := c.AllReduceDevice(ctx, uint64(p), n, w, op); err != nil {
								return fmt.Errorf("%s rank %d: %w", what, r, err)
							}
							got := make([]float32, n)
							if err := download(got, p, w); err != nil {
								return err
							}
							return sameBits(fmt.Sprintf("%s rank %d", what, r), got, func(i int) float32 { return fixedOrder(in, i, w, op) })
						})
					}
					in := randomInputs(uint64(w)+100, size, n, w)
					onAll(t, comms, func(r int, c *Comm) error {
						p, free, err := devBuf(w, n)
						if err != nil {
							return err
						}
						defer free()
						got := make([]float32, n)
						lo, hi := uneven[r], uneven[r+1]
						// Reduce-scatter: this rank's shard is the fixed-order sum; the rest is untouched.
						if err := upload(p, in[r], w); err != nil {
							return err
						}
						if err := c.ReduceScatterDevice(ctx, uint64(p), uneven, w, collective.Sum); err != nil {
							return fmt.Errorf("reduce-scatter %v rank %d: %w", w, r, err)
						}
						if err := download(got, p, w); err != nil {
							return err
						}
						if err := sameBits(fmt.Sprintf("reduce-scatter %v rank %d", w, r), got, func(i int) float32 {
							if i >= lo && i < hi {
								return fixedOrder(in, i, w, collective.Sum)
							}
							return in[r][i]
						}); err != nil {
							return err
						}
						if err := c.AllGatherDevice(ctx, uint64(p), uneven, w); err != nil {
							return fmt.Errorf("all-gather %v rank %d: %w", w, r, err)
						}
						if err := download(got, p, w); err != nil {
							return err
						}
						// All-gather: every rank's reduced shard, from that rank.
						if err := sameBits(fmt.Sprintf("all-gather %v rank %d", w, r), got, func(i int) float32 { return fixedOrder(in, i, w, collective.Sum) }); err != nil {
							return err
						}
						// Broadcast from the last rank.
						if err := upload(p, in[r], w); err != nil {
							return err
						}
						if err := c.BroadcastDevice(ctx, uint64(p), n, w, size-1); err != nil {
							return fmt.Errorf("broadcast %v rank %d: %w", w, r, err)
						}
						if err := download(got, p, w); err != nil {
							return err
						}
						return sameBits(fmt.Sprintf("broadcast %v rank %d", w, r), got, func(i int) float32 { return in[size-1][i] })
					})
				}
			})
		}
	}
}

// A peer whose communicator is aborted (its process timed out) fails the others: the
// collective a rank has queued gives up, and waiting for its stream must report the peer's
// failure rather than success (the stream finishes; the error is the communicator's). The
// next call fails at once with a peer error instead of waiting out the timeout.
func TestEmuPeerAbortFailsTheOthers(t *testing.T) {
	emulated(t, 2)
	comms := ncclGroup(t, 2)
	const n = 1000
	abort1 := func() {
		onAll(t, comms[1:], func(r int, c *Comm) error {
			c.mu.Lock()
			defer c.mu.Unlock()
			c.abort()
			c.broken = errors.New("aborted by the test")
			return nil
		})
	}
	start := time.Now()
	onAll(t, comms[:1], func(r int, c *Comm) error {
		p, free, err := devBuf(half.FP32, n)
		if err != nil {
			return err
		}
		defer free()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// An all-reduce rank 1 never joins: rank 1 is aborted while rank 0's stream waits.
		if err := c.issue(ctx, "ncclAllReduce", c.lib.allReduce(uintptr(p), uintptr(p), n, ncclFloat32, ncclSum, c.comm, c.streamHandle())); err != nil {
			return err
		}
		time.AfterFunc(200*time.Millisecond, abort1)
		err = c.sync(ctx)
		if !errors.Is(err, collective.ErrPeerGone) {
			return fmt.Errorf("waiting for the stream of an all-reduce whose peer aborted: %v, want an error wrapping collective.ErrPeerGone", err)
		}
		t.Logf("rank 0, after %v: %v", time.Since(start), err)
		err = c.AllReduceDevice(ctx, uint64(p), n, half.FP32, collective.Sum)
		if !errors.Is(err, collective.ErrPeerGone) {
			return fmt.Errorf("the next call: %v, want an error wrapping collective.ErrPeerGone", err)
		}
		return nil
	})
	if took := time.Since(start); took > 10*time.Second {
		t.Fatalf("rank 0 failed after %v", took)
	}
}

// The rendezvous segment: private to the user (0600) while the ranks gather, and unlinked
// both once they have all attached and when the only rank there gives up.
func TestEmuSegmentLifetime(t *testing.T) {
	emulated(t, 2)
	mine := func() []string {
		m, err := filepath.Glob(fmt.Sprintf("/dev/shm/qvd-nccl-emu-%d-*", os.Getpid()))
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	if m := mine(); len(m) != 0 {
		t.Fatalf("segments before the test: %v", m)
	}
	comms := ncclGroup(t, 2)
	if m := mine(); len(m) != 0 {
		t.Fatalf("a communicator of 2 ranks exists and its segment is still linked: %v", m)
	}
	_ = comms

	c := &Comm{rank: 0, size: 2, device: 0}
	if err := c.setup(); err != nil {
		t.Fatal(err)
	}
	defer c.release()
	id, err := c.newID()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	leave, err := c.enter()
	if err != nil {
		t.Fatal(err)
	}
	cfg := nonBlocking()
	if r := c.lib.commInitRankConfig(&c.comm, 2, id, 0, &cfg); r != ncclInProgress {
		leave()
		t.Fatalf("ncclCommInitRankConfig of rank 0 of 2, alone: %s", resultName(r))
	}
	var seg []string
	err = poll(ctx, func() (bool, error) { seg = mine(); return len(seg) == 1, nil })
	if err == nil {
		st, serr := os.Stat(seg[0])
		if serr != nil {
			err = serr
		} else if st.Mode().Perm() != 0o600 {
			err = fmt.Errorf("segment %s has mode %v, want 0600", seg[0], st.Mode().Perm())
		}
	}
	c.abort()
	leave()
	if err != nil {
		t.Fatal(err)
	}
	if m := mine(); len(m) != 0 {
		t.Fatalf("rank 0 gave up alone and its segment is still linked: %v", m)
	}
}
