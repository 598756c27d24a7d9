//go:build linux

package shmnet

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/qvd/qvd/collective"
)

func TestConfigValidate(t *testing.T) {
	ok := DefaultConfig()
	for _, tc := range []struct {
		name string
		mod  func(*Config)
		want string // substring of the error; "" = valid
	}{
		{"default", func(*Config) {}, ""},
		{"ring not a power of two", func(c *Config) { c.RingBytes = 3 << 20 }, "ring_bytes"},
		{"ring too small", func(c *Config) { c.RingBytes = 4 << 10 }, "ring_bytes"},
		{"attach timeout", func(c *Config) { c.AttachTimeout = 0 }, "attach_timeout"},
		{"negative spin", func(c *Config) { c.Spin = -1 }, "spin"},
		{"poll interval", func(c *Config) { c.PollInterval = 0 }, "poll_interval"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := ok
			tc.mod(&c)
			err := c.Validate()
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("Validate() = %v, want an error naming %q", err, tc.want)
			}
		})
	}
}

func TestGroupValidate(t *testing.T) {
	secret := make([]byte, 16)
	for _, tc := range []struct {
		name string
		g    Group
		want string
	}{
		{"ok", Group{Job: "j-1.a_b", Rank: 1, Size: 2, Secret: secret}, ""},
		{"bad job", Group{Job: "a/b", Rank: 0, Size: 1, Secret: secret}, "job id"},
		{"empty job", Group{Job: "", Rank: 0, Size: 1, Secret: secret}, "job id"},
		{"rank out of range", Group{Job: "j", Rank: 2, Size: 2, Secret: secret}, "rank 2"},
		{"short secret", Group{Job: "j", Rank: 0, Size: 1, Secret: secret[:8]}, "secret"},
		{"addrs", Group{Job: "j", Rank: 0, Size: 2, Secret: secret, Addrs: []string{"a"}}, "addrs"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.g.validate()
			if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("validate() = %v, want an error with %q", err, tc.want)
			}
		})
	}
}

func TestNamePid(t *testing.T) {
	for _, tc := range []struct {
		name string
		pid  int
		ok   bool
	}{
		{"qvd-job-0-123", 123, true},
		{"qvd-a-1-2-555", 555, true},
		{"qvd-job-0-", 0, false},
		{"qvd-job-0-12x", 0, false},
		{"other-1-2", 0, false},
	} {
		pid, ok := namePid(tc.name)
		if pid != tc.pid || ok != tc.ok {
			t.Errorf("namePid(%q) = %d, %v; want %d, %v", tc.name, pid, ok, tc.pid, tc.ok)
		}
	}
}

// TestFrames sends frames of many sizes both ways, including ones larger than the ring
// (streamed) and empty ones, with the receiver reading each into a buffer, into its
// destination (RecvInto) or in place in the ring (RecvApply).
func TestFrames(t *testing.T) {
	checkLeaks(t)
	g := newGroup(t, 2, testConfig()) // 256 KiB rings
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sizes := []int{0, 4, 60, 64, 68, 4096, 65536, 100 << 10, 255 << 10, 256 << 10, 1 << 20, 3<<20 + 12, 4, 200<<10 + 4, 300 << 10, 12}
	done := make(chan error, 1)
	go func() {
		buf := make([]byte, 4<<20)
		for i, n := range sizes {
			var h collective.Header
			var p []byte
			var err error
			switch i % 3 {
			case 0:
				h, p, err = g.ts[1].Recv(ctx, 0, buf)
			case 2:
				// In place: the parts must tile the payload in order, aligned but for the last.
				applied := make([]byte, n)
				next := 0
				h, p, err = g.ts[1].RecvApply(ctx, 0, buf[:0], func(collective.Header) func(int, []byte) {
					return func(off int, part []byte) {
						if off != next || off+len(part) < n && len(part)%collective.ApplyAlign != 0 {
							err = fmt.Errorf("part [%d, +%d) after %d bytes of %d", off, len(part), next, n)
						}
						next = off + copy(applied[off:], part)
					}
				})
				if err == nil && (p != nil || next != n) {
					err = fmt.Errorf("RecvApply returned %d bytes and applied %d of %d", len(p), next, n)
				}
				p = applied
			default:
				direct := make([]byte, n)
				h, p, err = g.ts[1].RecvInto(ctx, 0, buf[:0], func(collective.Header) []byte { return direct })
				if err == nil && n > 0 && &p[0] != &direct[0] {
					err = errors.New("RecvInto did not land the payload in dst")
				}
			}
			if err != nil {
				done <- err
				return
			}
			if int(h.Length) != n || len(p) != n || h.Piece != uint32(i) {
				done <- errors.New("wrong frame " + strconv.Itoa(i))
				return
			}
			if err := checkFill(p, uint64(i)); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	for i, n := range sizes {
		p := make([]byte, n)
		fill(p, uint64(i))
		h := dataHeader(0, n)
		h.Piece = uint32(i)
		if err := g.ts[0].Send(ctx, 1, h, p); err != nil {
			t.Fatalf("send %d (%d bytes): %v", i, n, err)
		}
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestRecvBufferTooSmall: an error naming the sender, and the link stays in step.
func TestRecvBufferTooSmall(t *testing.T) {
	g := newGroup(t, 2, testConfig())
	ctx := context.Background()
	for i, n := range []int{1000, 8} {
		p := make([]byte, n)
		fill(p, uint64(i))
		if err := g.ts[0].Send(ctx, 1, dataHeader(0, n), p); err != nil {
			t.Fatal(err)
		}
	}
	_, _, err := g.ts[1].Recv(ctx, 0, make([]byte, 100))
	wantPeerErr(t, err, 0, collective.ErrProtocol)
	_, p, err := g.ts[1].Recv(ctx, 0, make([]byte, 100))
	if err != nil {
		t.Fatal(err)
	}
	if err := checkFill(p, 1); err != nil {
		t.Fatalf("the frame after the refused one: %v", err)
	}
}

func TestSelfAndRange(t *testing.T) {
	g := newGroup(t, 2, testConfig())
	ctx := context.Background()
	if err := g.ts[0].Send(ctx, 0, dataHeader(0, 0), nil); err == nil {
		t.Error("send to self succeeded")
	}
	if _, _, err := g.ts[0].Recv(ctx, 0, nil); err == nil {
		t.Error("receive from self succeeded")
	}
	if err := g.ts[0].Send(ctx, 5, dataHeader(0, 0), nil); err == nil {
		t.Error("send to rank 5 of 2 succeeded")
	}
	if err := g.ts[0].Send(ctx, 1, dataHeader(0, 8), make([]byte, 4)); err == nil {
		t.Error("send with a wrong length succeeded")
	}
}

// TestCloseUnblocks: Close makes this rank's blocked calls return ErrClosed, and its peer's
// ErrPeerGone naming it (after the frames it sent before closing), at once.
func TestCloseUnblocks(t *testing.T) {
	checkLeaks(t)
	cfg := testConfig()
	cfg.PollInterval = time.Second // so only the wakes can explain a fast return
	g := newGroup(t, 3, cfg)
	ctx := context.Background()
	errc := make(chan error, 2)
	go func() { _, _, err := g.ts[0].Recv(ctx, 1, make([]byte, 64)); errc <- err }()
	go func() {
		// Fill the ring to 2 so the Send blocks.
		p := make([]byte, 128<<10)
		for {
			if err := g.ts[0].Send(ctx, 2, dataHeader(0, len(p)), p); err != nil {
				errc <- err
				return
			}
		}
	}()
	time.Sleep(50 * time.Millisecond)
	start := time.Now()
	_ = g.ts[0].Close()
	for range 2 {
		if err := <-errc; !errors.Is(err, collective.ErrClosed) {
			t.Fatalf("blocked call after Close: %v, want ErrClosed", err)
		}
	}
	if el := time.Since(start); el > 500*time.Millisecond {
		t.Fatalf("blocked calls took %v to return after Close", el)
	}
	_ = g.ts[0].Close() // twice is fine

	// Rank 2 still gets what rank 0 sent before closing, then ErrPeerGone naming rank 0.
	buf := make([]byte, 128<<10)
	for {
		_, _, err := g.ts[2].Recv(ctx, 0, buf)
		if err != nil {
			wantPeerErr(t, err, 0, collective.ErrPeerGone)
			break
		}
	}
	// Rank 1 sending to the closed rank 0 fails too.
	err := g.ts[1].Send(ctx, 0, dataHeader(1, 4), make([]byte, 4))
	wantPeerErr(t, err, 0, collective.ErrPeerGone)
}

// TestKilledPeer: a peer whose process dies (no closed flag) is reported within about one
// PollInterval to a blocked Recv and a blocked Send.
func TestKilledPeer(t *testing.T) {
	cfg := testConfig()
	g := newGroup(t, 3, cfg)
	// Bounded, so a transport that never notices the death fails here rather than hangs.
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	p := make([]byte, 200<<10)
	if err := g.ts[1].Send(ctx, 2, dataHeader(1, len(p)), p); err != nil { // ring to 2 nearly full
		t.Fatal(err)
	}
	errc := make(chan error, 2)
	go func() { _, _, err := g.ts[0].Recv(ctx, 2, make([]byte, 64)); errc <- err }()
	go func() { errc <- g.ts[1].Send(ctx, 2, dataHeader(1, len(p)), p) }()
	time.Sleep(30 * time.Millisecond)
	start := time.Now()
	g.kill(2)
	for range 2 {
		wantPeerErr(t, <-errc, 2, collective.ErrPeerGone)
	}
	if el := time.Since(start); el > 10*cfg.PollInterval {
		t.Fatalf("death noticed after %v, want about %v", el, cfg.PollInterval)
	}
}

// TestCtx: a blocked Recv returns its ctx's error on the deadline and on cancellation, and
// the link still works afterwards.
func TestCtx(t *testing.T) {
	g := newGroup(t, 2, testConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, _, err := g.ts[1].Recv(ctx, 0, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Recv past its deadline: %v", err)
	}
	if el := time.Since(start); el > 200*time.Millisecond {
		t.Fatalf("Recv returned %v after a 30ms deadline", el)
	}
	cctx, ccancel := context.WithCancel(context.Background())
	time.AfterFunc(20*time.Millisecond, ccancel)
	if _, _, err := g.ts[1].Recv(cctx, 0, nil); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Recv: %v", err)
	}
	if err := g.ts[0].Send(context.Background(), 1, dataHeader(0, 4), []byte{1, 2, 3, 4}); err != nil {
		t.Fatal(err)
	}
	if _, p, err := g.ts[1].Recv(context.Background(), 0, make([]byte, 4)); err != nil || p[3] != 4 {
		t.Fatalf("after the cancelled Recv: %v %v", p, err)
	}
}

// TestNoLeftovers: once New returns, no segment file is left; after Close, no descriptor and
// no mapping of them either (counted from /proc, not by our own bookkeeping).
func TestNoLeftovers(t *testing.T) {
	fds := openFDs(t)
	g := newGroup(t, 3, testConfig())
	if left := segFiles(t, g.dir); len(left) != 0 {
		t.Fatalf("segment files left after attaching: %v", left)
	}
	if m := mappedFrom(t, g.dir); m == 0 {
		t.Fatalf("no mapping of %s while attached: the check below would prove nothing", g.dir)
	}
	ctx := context.Background()
	if err := g.ts[0].Send(ctx, 1, dataHeader(0, 4), make([]byte, 4)); err != nil {
		t.Fatal(err)
	}
	for _, tr := range g.ts {
		_ = tr.Close()
	}
	if m := mappedFrom(t, g.dir); m != 0 {
		t.Fatalf("%d mappings of %s left after Close", m, g.dir)
	}
	if now := openFDs(t); now != fds {
		t.Fatalf("%d descriptors open before the group, %d after Close", fds, now)
	}
}

// TestStaleSweep: the next New removes the segment files no process holds and keeps those
// a process holds, whatever the pids in their names say: a file named after a live pid but
// not locked is stale, one named after a dead pid (or pid 1, as in a container) but locked
// is live.
func TestStaleSweep(t *testing.T) {
	dir := t.TempDir()
	dead := deadPid(t)
	stale := []string{
		filepath.Join(dir, segName("oldjob", 0, dead)),
		filepath.Join(dir, segName("oldjob", 1, os.Getpid())), // a live pid, but nobody holds the file
	}
	live := []string{
		filepath.Join(dir, segName("oldjob", 2, dead)),
		filepath.Join(dir, segName("oldjob", 3, 1)),
	}
	for _, p := range append(append([]string(nil), stale...), live...) {
		if err := os.WriteFile(p, make([]byte, pageSize), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range live { // held as a creator holds its segment
		f, err := os.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := lockOwner(int(f.Fd())); err != nil {
			t.Fatal(err)
		}
	}
	core, logs := observer.New(zapcore.InfoLevel)
	tr, err := New(context.Background(), Group{Job: "j", Rank: 0, Size: 1, Secret: newSecret(t), Dir: dir}, testConfig(), zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	_ = tr.Close()
	for _, p := range stale {
		if _, err := os.Stat(p); !os.IsNotExist(err) {
			t.Errorf("the unheld segment %s is still there: %v", p, err)
		}
	}
	for _, p := range live {
		if _, err := os.Stat(p); err != nil {
			t.Errorf("the held segment %s was removed: %v", p, err)
		}
	}
	if n := logs.FilterMessage("removed a stale shared-memory segment").Len(); n != len(stale) {
		t.Fatalf("%d removals logged, want %d: %v", n, len(stale), logs.All())
	}
}

// deadPid returns the pid of a process that has exited and been reaped.
func deadPid(t testing.TB) int {
	t.Helper()
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skipf("cannot run true: %v", err)
	}
	return cmd.Process.Pid
}

// TestForeignSegment: segments that fail the checks are refused with an error naming the
// file and the reason, wrapping collective.ErrAuth.
func TestForeignSegment(t *testing.T) {
	secret := newSecret(t)
	cfg := testConfig()
	cfg.AttachTimeout = 2 * time.Second
	ctx := context.Background()
	attach := func(dir string) error {
		tr, err := open(ctx, Group{Job: "j", Rank: 1, Size: 2, Secret: secret, Dir: dir}, cfg, nil, os.Getpid())
		if err == nil {
			_ = tr.Close()
		}
		return err
	}
	// plant makes rank 0's segment as a live peer would (holding its lock until the test
	// ends, so the sweep leaves it alone), with the given secret, then chmods it.
	plant := func(t *testing.T, dir string, sec []byte, mode os.FileMode) string {
		s, err := createSegment(dir, "j", 0, 2, cfg.RingBytes, cfg.ArenaBytes, os.Getpid(), sec)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.unmap)
		if err := os.Chmod(s.path, mode); err != nil {
			t.Fatal(err)
		}
		return s.path
	}
	for _, tc := range []struct {
		name   string
		secret []byte
		mode   os.FileMode
		chown  bool
		want   string
	}{
		{"wrong secret", newSecret(t), 0o600, false, "token does not verify"},
		{"mode 0644", secret, 0o644, false, "mode 0644"},
		{"mode 0660", secret, 0o660, false, "mode 0660"},
		{"other owner", secret, 0o600, true, "owned by uid"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := plant(t, dir, tc.secret, tc.mode)
			if tc.chown {
				if os.Geteuid() != 0 {
					t.Skip("chown to another user needs root")
				}
				if err := os.Chown(path, 65534, 65534); err != nil {
					t.Skipf("chown: %v", err)
				}
			}
			start := time.Now()
			err := attach(dir)
			if err == nil || !errors.Is(err, collective.ErrAuth) || !strings.Contains(err.Error(), path) ||
				!strings.Contains(err.Error(), tc.want) {
				t.Fatalf("attach: %v\nwant ErrAuth naming %s and %q", err, path, tc.want)
			}
			if el := time.Since(start); el > cfg.AttachTimeout/2 {
				t.Fatalf("refused after %v: it should not wait for the timeout", el)
			}
			if left := segFiles(t, dir); len(left) != 1 {
				t.Fatalf("files left: %v, want only the planted one", left)
			}
		})
	}
}

// TestBadProof: a process that attaches to this rank's segment without the secret (its
// proof does not verify) makes New fail, naming it.
func TestBadProof(t *testing.T) {
	dir := t.TempDir()
	secret := newSecret(t)
	cfg := testConfig()
	errc := make(chan error, 1)
	go func() {
		tr, err := open(context.Background(), Group{Job: "j", Rank: 0, Size: 2, Secret: secret, Dir: dir}, cfg, nil, os.Getpid())
		if err == nil {
			_ = tr.Close()
		}
		errc <- err
	}()
	// A forger with our uid but not the secret attaches to rank 0's segment as rank 1 with a
	// proof made from a guessed secret.
	forged := newSecret(t)
	var seg *segment
	for deadline := time.Now().Add(5 * time.Second); seg == nil; {
		if time.Now().After(deadline) {
			t.Fatal("rank 0's segment never appeared")
		}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "qvd-j-0-") {
				seg, _ = openSegment(filepath.Join(dir, e.Name()), "j", 0, 2, os.Getpid(), secret)
			}
		}
		time.Sleep(time.Millisecond)
	}
	defer seg.unmap()
	sl := seg.slot(1)
	var own [16]byte
	binary.LittleEndian.PutUint64(sl.ctl[slotPid:], uint64(os.Getpid()))
	copy(sl.ctl[slotPf:], proof(forged, "j", 0, 1, os.Getpid(), seg.nonce[:], own[:]))
	sl.attached.Store(1)
	err := <-errc
	if err == nil || !errors.Is(err, collective.ErrAuth) || !strings.Contains(err.Error(), "rank 1") {
		t.Fatalf("New with a forged attach: %v, want ErrAuth naming rank 1", err)
	}
}

func TestAttachTimeout(t *testing.T) {
	dir := t.TempDir()
	cfg := testConfig()
	cfg.AttachTimeout = 100 * time.Millisecond
	_, err := New(context.Background(), Group{Job: "j", Rank: 0, Size: 3, Secret: newSecret(t), Dir: dir}, cfg, nil)
	if err == nil || !errors.Is(err, collective.ErrTimeout) || !strings.Contains(err.Error(), "rank(s) 1,2") {
		t.Fatalf("New with no peers: %v, want a timeout naming ranks 1,2", err)
	}
	if left := segFiles(t, dir); len(left) != 0 {
		t.Fatalf("files left after a failed New: %v", left)
	}
}

func TestAvailable(t *testing.T) {
	if err := Available(t.TempDir()); err != nil {
		t.Fatal(err)
	}
	if err := Available(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Fatal("Available on a missing directory: nil error")
	}
}
