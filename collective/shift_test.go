package collective_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
	"github.com/qvd/qvd/collective/tcpnet"
)

// shiftInputs gives rank r a buffer of its own length (empty for rank 2), with bits a
// float operation would change: NaN payloads, -0, denormals.
func shiftInputs(n int) [][]float32 {
	bufs := make([][]float32, n)
	for r := range n {
		l := 5000*(r+1) + 3*r // several pieces of a 16 KiB chunk, and ragged
		if r == 2 {
			l = 0
		}
		b := make([]float32, l)
		for i := range b {
			b[i] = float32(r*1000 + i%977)
		}
		if l > 3 {
			b[0], b[1], b[2] = math.Float32frombits(0x7fc00123), float32(math.Copysign(0, -1)), math.Float32frombits(1)
		}
		bufs[r] = b
	}
	return bufs
}

// checkShifted fails unless every rank's recv is its predecessor's send, bit for bit.
func checkShifted(t *testing.T, send, recv [][]float32) {
	t.Helper()
	n := len(send)
	for r := range n {
		want := send[(r+n-1)%n]
		if len(recv[r]) != len(want) {
			t.Fatalf("rank %d received %d elements, want %d", r, len(recv[r]), len(want))
		}
		for i := range want {
			if math.Float32bits(recv[r][i]) != math.Float32bits(want[i]) {
				t.Fatalf("rank %d element %d: %#x, want %#x", r, i, math.Float32bits(recv[r][i]), math.Float32bits(want[i]))
			}
		}
	}
}

// recvBufs allocates each rank's recv for its predecessor's send, filled with junk.
func recvBufs(send [][]float32) [][]float32 {
	n := len(send)
	recv := make([][]float32, n)
	for r := range n {
		recv[r] = make([]float32, len(send[(r+n-1)%n]))
		for i := range recv[r] {
			recv[r][i] = -7
		}
	}
	return recv
}

// hidden hides a Ring's Shift, so collective.Shift takes the fallback over AllGather.
type hidden struct{ collective.Communicator }

func TestShift(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	for _, n := range []int{1, 2, 3, 5} {
		for _, fallback := range []bool{false, true} {
			t.Run(fmt.Sprintf("N%d/fallback=%v", n, fallback), func(t *testing.T) {
				rings, _, _ := inprocGroup(t, n, testConfig(5*time.Second))
				send := shiftInputs(n)
				recv := recvBufs(send)
				if n == 1 {
					recv[0] = make([]float32, len(send[0]))
				}
				errs, _ := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
					var comm collective.Communicator = ring
					if fallback {
						comm = hidden{ring}
					}
					return collective.Shift(ctx, comm, send[r], recv[r], collective.Call{Tag: 9})
				})
				if err := errors.Join(errs...); err != nil {
					t.Fatal(err)
				}
				checkShifted(t, send, recv)
			})
		}
	}
}

// TestShiftFallbackRounds: buffers longer than one round of the fallback's all-gathers.
func TestShiftFallbackRounds(t *testing.T) {
	const n = 3
	rings, _, _ := inprocGroup(t, n, testConfig(5*time.Second))
	send := make([][]float32, n)
	for r := range n {
		send[r] = make([]float32, []int{600_000, 10, 262_144}[r])
		for i := range send[r] {
			send[r][i] = float32(i*(r+1)) + 0.5
		}
	}
	recv := recvBufs(send)
	errs, _ := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
		return collective.Shift(ctx, hidden{ring}, send[r], recv[r], collective.Call{})
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	checkShifted(t, send, recv)
}

// TestShiftConcurrent: a tagged shift runs while the ranks' untagged all-reduces go on, as
// elastic snapshots run beside the training step, and neither disturbs the other.
func TestShiftConcurrent(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const n = 4
	rings, _, _ := inprocGroup(t, n, testConfig(5*time.Second))
	send := shiftInputs(n)
	recv := recvBufs(send)
	bufs := intInputs(n, 30000)
	errs, _ := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
		done := make(chan error, 1)
		go func() { done <- ring.Shift(ctx, send[r], recv[r], collective.Call{Tag: 1 << 40}) }()
		var err error
		for i := range 3 {
			if i > 0 {
				vecScale(bufs[r], 1/float32(n)) // back to the inputs' sum / n, exactly
			}
			if err = ring.AllReduce(ctx, bufs[r], collective.Sum, collective.Call{}); err != nil {
				break
			}
		}
		return errors.Join(err, <-done)
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	checkShifted(t, send, recv)
	checkIntSum(t, bufs)
}

// vecScale multiplies x by s.
func vecScale(x []float32, s float32) {
	for i := range x {
		x[i] *= s
	}
}

// TestShiftErrors: a wrong receive length fails on the receiver as a protocol error, a
// cancelled context ends a shift whose predecessor never sends, and a dead predecessor is
// named, all without waiting out the timeout.
func TestShiftErrors(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	const n, timeout = 3, 3 * time.Second
	t.Run("length", func(t *testing.T) {
		rings, _, _ := inprocGroup(t, n, testConfig(timeout))
		errs, took := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
			return ring.Shift(ctx, make([]float32, 100), make([]float32, 100+r%2), collective.Call{Tag: 3})
		})
		if !errors.Is(errs[1], collective.ErrProtocol) {
			t.Errorf("rank 1 expected 101 elements and got 100: %v, want ErrProtocol", errs[1])
		}
		if took > timeout {
			t.Errorf("took %v", took)
		}
	})
	t.Run("context", func(t *testing.T) {
		rings, _, _ := inprocGroup(t, n, testConfig(timeout))
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := rings[1].Shift(ctx, make([]float32, 10), make([]float32, 10), collective.Call{Tag: 3})
		if !errors.Is(err, context.DeadlineExceeded) || time.Since(start) > timeout/2 {
			t.Errorf("after %v: %v, want the context's deadline", time.Since(start), err)
		}
	})
	t.Run("dead", func(t *testing.T) {
		rings, net, _ := inprocGroup(t, n, testConfig(timeout))
		net.Kill(0)
		start := time.Now()
		err := rings[1].Shift(context.Background(), make([]float32, 10), make([]float32, 10), collective.Call{Tag: 3})
		var pe *collective.PeerError
		if !errors.As(err, &pe) || pe.Rank != 0 || time.Since(start) > timeout+timeout/2 {
			t.Errorf("after %v: %v, want a PeerError naming rank 0", time.Since(start), err)
		}
	})
}

// TestShiftTCP: the shift over the raw-TCP transport, concurrently with an all-reduce.
func TestShiftTCP(t *testing.T) {
	const n = 3
	lns := make([]*tcpnet.Listener, n)
	addrs := make([]string, n)
	for r := range n {
		l, err := tcpnet.Listen("127.0.0.1:0", zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		lns[r], addrs[r] = l, l.Addr()
	}
	secret := []byte("0123456789abcdef0123456789abcdef")
	rings := make([]*collective.Ring, n)
	ts := make([]collective.Transport, n)
	for r := range n {
		tr, err := lns[r].Transport(context.Background(), tcpnet.Group{Job: "shift-" + t.Name(), Rank: r, Addrs: addrs, Secret: secret})
		if err != nil {
			t.Fatal(err)
		}
		ring, err := collective.NewRing(tr, collective.Config{Transport: "tcp", Timeout: 5 * time.Second, ChunkBytes: 64 << 10})
		if err != nil {
			t.Fatal(err)
		}
		rings[r], ts[r] = ring, tr
	}
	defer closeAll(rings, ts)
	send := shiftInputs(n)
	recv := recvBufs(send)
	bufs := intInputs(n, 30000)
	errs, _ := onAll(t, rings, func(ctx context.Context, r int, ring *collective.Ring) error {
		done := make(chan error, 1)
		go func() { done <- ring.Shift(ctx, send[r], recv[r], collective.Call{Tag: 5}) }()
		err := ring.AllReduce(ctx, bufs[r], collective.Sum, collective.Call{})
		return errors.Join(err, <-done)
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	checkShifted(t, send, recv)
	checkIntSum(t, bufs)
}

func closeAll(rings []*collective.Ring, ts []collective.Transport) {
	for r := range rings {
		rings[r].Close()
		ts[r].Close()
	}
}
