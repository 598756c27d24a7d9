package collective_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/collectivetest"
)

func dataHeader(tag uint64, n int) collective.Header {
	return collective.Header{Kind: collective.KindData, Op: collective.OpAllReduce, Tag: tag, Count: uint32(n / 4), Length: uint32(n)}
}

func recvWithin(t *testing.T, tr collective.Transport, peer int, d time.Duration) (collective.Header, []byte, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	return tr.Recv(ctx, peer, make([]byte, 1024))
}

func TestInprocOrderAndCopy(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	_, ts := collective.NewInproc(2, 1)
	ctx := context.Background()
	p := []byte{1, 2, 3, 4}
	for i := range 10 {
		p[0] = byte(i)
		if err := ts[0].Send(ctx, 1, dataHeader(uint64(i), 4), p); err != nil {
			t.Fatal(err)
		}
	}
	p[0] = 99 // the transport copied each payload
	for i := range 10 {
		h, got, err := ts[1].Recv(ctx, 0, make([]byte, 16))
		if err != nil || h.Tag != uint64(i) || !bytes.Equal(got, []byte{byte(i), 2, 3, 4}) {
			t.Fatalf("frame %d: %+v %v %v", i, h, got, err)
		}
	}
	if ts[0].Addr(1) == "" || ts[0].Addr(5) != "" || ts[1].Rank() != 1 || ts[1].Size() != 2 {
		t.Error("Addr, Rank or Size wrong")
	}
	// A payload too big for the receiver's buffer is an error, not a truncation.
	if err := ts[0].Send(ctx, 1, dataHeader(0, 64), make([]byte, 64)); err != nil {
		t.Fatal(err)
	}
	if _, _, err := ts[1].Recv(ctx, 0, make([]byte, 16)); !errors.Is(err, collective.ErrProtocol) {
		t.Errorf("oversize frame: %v, want ErrProtocol", err)
	}
	if err := ts[0].Send(ctx, 1, dataHeader(0, 8), make([]byte, 4)); err == nil {
		t.Error("Send accepted a header whose length is not the payload's")
	}
	ts[0].Close()
	ts[0].Close()
	ts[1].Close()
}

// dropped sends 300 frames over a link that drops half, then an end marker over the healed
// link, and returns the tags that arrived.
func dropped(t *testing.T, seed uint64) []uint64 {
	net, ts := collective.NewInproc(2, seed)
	defer ts[0].Close()
	defer ts[1].Close()
	const end = 1000
	gotc := make(chan []uint64)
	go func() {
		var got []uint64
		for {
			h, _, err := ts[1].Recv(context.Background(), 0, nil)
			if err != nil || h.Tag == end {
				gotc <- got
				return
			}
			got = append(got, h.Tag)
		}
	}()
	net.SetDrop(0, 1, 0.5)
	for i := range 300 {
		if err := ts[0].Send(context.Background(), 1, dataHeader(uint64(i), 0), nil); err != nil {
			t.Fatal(err)
		}
	}
	net.SetDrop(0, 1, 0)
	if err := ts[0].Send(context.Background(), 1, dataHeader(end, 0), nil); err != nil {
		t.Fatal(err)
	}
	return <-gotc
}

func TestInprocDropSeeded(t *testing.T) {
	a, b, c := dropped(t, 42), dropped(t, 42), dropped(t, 43)
	if !slices.Equal(a, b) {
		t.Errorf("the same seed dropped different frames")
	}
	if slices.Equal(a, c) {
		t.Errorf("different seeds dropped the same frames")
	}
	if len(a) < 100 || len(a) > 200 {
		t.Errorf("%d of 300 frames arrived with p = 0.5", len(a))
	}
	if !slices.IsSorted(a) {
		t.Errorf("drops reordered the link: %v", a)
	}
}

func TestInprocPartition(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	net, ts := collective.NewInproc(3, 1)
	ctx := context.Background()
	net.Partition([]int{0}) // 0 alone; 1 and 2 together
	for i := range 3 {
		if err := ts[0].Send(ctx, 1, dataHeader(uint64(i), 0), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := ts[2].Send(ctx, 1, dataHeader(7, 0), nil); err != nil {
		t.Fatal(err)
	}
	if h, _, err := recvWithin(t, ts[1], 2, time.Second); err != nil || h.Tag != 7 {
		t.Errorf("within a group: %+v %v", h, err)
	}
	if _, _, err := recvWithin(t, ts[1], 0, 50*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("across the partition: %v, want the frame held", err)
	}
	// A Recv blocked on a held frame wakes when the partition heals.
	go func() { time.Sleep(20 * time.Millisecond); net.Heal() }()
	for i := range 3 {
		if h, _, err := recvWithin(t, ts[1], 0, 5*time.Second); err != nil || h.Tag != uint64(i) {
			t.Fatalf("after Heal, frame %d: %+v %v", i, h, err)
		}
	}
	for _, tr := range ts {
		tr.Close()
	}
}

func TestInprocDelay(t *testing.T) {
	net, ts := collective.NewInproc(2, 1)
	defer ts[0].Close()
	defer ts[1].Close()
	ctx := context.Background()
	net.SetDelay(0, 1, 40*time.Millisecond)
	start := time.Now()
	if err := ts[0].Send(ctx, 1, dataHeader(0, 0), nil); err != nil {
		t.Fatal(err)
	}
	net.SetDelay(0, 1, 0) // a later frame with less delay must not overtake
	if err := ts[0].Send(ctx, 1, dataHeader(1, 0), nil); err != nil {
		t.Fatal(err)
	}
	for i := range 2 {
		h, _, err := recvWithin(t, ts[1], 0, 5*time.Second)
		if err != nil || h.Tag != uint64(i) {
			t.Fatalf("frame %d: %+v %v", i, h, err)
		}
	}
	if el := time.Since(start); el < 40*time.Millisecond {
		t.Errorf("delayed frame arrived after %v", el)
	}
}

func TestInprocKill(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	net, ts := collective.NewInproc(3, 1)
	ctx := context.Background()
	errc := make(chan error, 1)
	go func() { _, _, err := ts[1].Recv(ctx, 0, make([]byte, 16)); errc <- err }()
	time.Sleep(10 * time.Millisecond)
	net.Kill(0)
	var pe *collective.PeerError
	if err := <-errc; !errors.As(err, &pe) || pe.Rank != 0 || !errors.Is(err, collective.ErrPeerGone) {
		t.Errorf("Recv from a killed rank: %v, want ErrPeerGone naming rank 0", err)
	}
	if err := ts[2].Send(ctx, 0, dataHeader(0, 0), nil); !errors.Is(err, collective.ErrPeerGone) {
		t.Errorf("Send to a killed rank: %v, want ErrPeerGone", err)
	}
	if err := ts[0].Send(ctx, 1, dataHeader(0, 0), nil); !errors.Is(err, collective.ErrClosed) {
		t.Errorf("Send from a killed rank: %v, want ErrClosed", err)
	}
	if _, _, err := ts[0].Recv(ctx, 1, nil); !errors.Is(err, collective.ErrClosed) {
		t.Errorf("Recv on a killed rank: %v, want ErrClosed", err)
	}
	// A Send blocked on a full link gives up when its context ends.
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	var err error
	for i := 0; err == nil && i < 1000; i++ {
		err = ts[1].Send(cctx, 2, dataHeader(0, 0), nil)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Send on a full link: %v, want DeadlineExceeded", err)
	}
	for _, tr := range ts {
		tr.Close()
	}
}

// TestInprocCloseDeliversSent: a closed rank's frames still reach their receiver, as a
// socket's buffered bytes do before its FIN, and only then is it gone; a killed rank's are
// lost.
func TestInprocCloseDeliversSent(t *testing.T) {
	collectivetest.CheckGoroutines(t)
	for _, kill := range []bool{false, true} {
		t.Run(fmt.Sprintf("kill=%v", kill), func(t *testing.T) {
			net, ts := collective.NewInproc(2, 1)
			defer func() {
				for _, tr := range ts {
					tr.Close()
				}
			}()
			ctx := context.Background()
			for i := range 2 {
				if err := ts[0].Send(ctx, 1, dataHeader(uint64(i), 1), []byte{byte(i)}); err != nil {
					t.Fatal(err)
				}
			}
			if kill {
				net.Kill(0)
			} else {
				ts[0].Close()
			}
			buf := make([]byte, 1)
			for i := range 2 {
				_, p, err := ts[1].Recv(ctx, 0, buf)
				if kill {
					if !errors.Is(err, collective.ErrPeerGone) {
						t.Fatalf("Recv %d from a killed rank: %v, want ErrPeerGone", i, err)
					}
					return
				}
				if err != nil || len(p) != 1 || p[0] != byte(i) {
					t.Fatalf("Recv %d from a closed rank: %v, %v; want its frame %d", i, p, err, i)
				}
			}
			var pe *collective.PeerError
			if _, _, err := ts[1].Recv(ctx, 0, buf); !errors.As(err, &pe) || pe.Rank != 0 || !errors.Is(err, collective.ErrPeerGone) {
				t.Fatalf("Recv past a closed rank's last frame: %v, want ErrPeerGone naming rank 0", err)
			}
			if err := ts[1].Send(ctx, 0, dataHeader(0, 0), nil); !errors.Is(err, collective.ErrPeerGone) {
				t.Fatalf("Send to a closed rank: %v, want ErrPeerGone", err)
			}
		})
	}
}
