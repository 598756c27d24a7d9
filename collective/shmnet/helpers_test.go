//go:build linux

package shmnet

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/leakcheck"
)

// fakePid numbers the ranks that run in this test process: their pids only name segments
// and appear in messages (liveness is the segment lock's, see lock.go), so made-up pids far
// above pid_max do, and prove that nothing depends on them.
var fakePid atomic.Int64

func init() { fakePid.Store(1 << 30) }

// testConfig: small rings so frames wrap and stream, short polls so deaths show fast.
func testConfig() Config {
	c := DefaultConfig()
	c.RingBytes = 256 << 10
	c.AttachTimeout = 5 * time.Second
	c.PollInterval = 10 * time.Millisecond
	return c
}

func newSecret(t testing.TB) []byte {
	s := make([]byte, 32)
	if _, err := rand.Read(s); err != nil {
		t.Fatal(err)
	}
	return s
}

var jobSeq atomic.Int64

// group is n ranks of one job in one process, each with a made-up pid.
type group struct {
	dir  string
	job  string
	ts   []*transport
	pids []int
}

// newGroup attaches n ranks (concurrently: New waits for every peer) in a fresh directory,
// closing them at cleanup.
func newGroup(t testing.TB, n int, cfg Config) *group {
	t.Helper()
	g := &group{dir: t.TempDir(), job: fmt.Sprint("test-", jobSeq.Add(1))}
	secret := newSecret(t)
	g.ts = make([]*transport, n)
	g.pids = make([]int, n)
	for r := range g.pids {
		g.pids[r] = int(fakePid.Add(1))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := onAll(n, func(r int) error {
		tr, err := open(ctx, Group{Job: g.job, Rank: r, Size: n, Secret: secret, Dir: g.dir}, cfg, zap.NewNop(), g.pids[r])
		g.ts[r] = tr
		return err
	})
	for _, tr := range g.ts {
		if tr != nil {
			t.Cleanup(func() { _ = tr.Close() })
		}
	}
	if err != nil {
		t.Fatal(err)
	}
	return g
}

// kill makes rank r die as a SIGKILL would look to its peers: its rings are left as they
// were, without the closed flags, and its descriptors close, which drops its segment's lock
// as the kernel does when a process dies.
func (g *group) kill(r int) {
	g.ts[r].once.Do(func() { g.ts[r].shutdown(false) })
}

// onAll runs fn for every rank at once and joins their errors.
func onAll(n int, fn func(r int) error) error {
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(r); err != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

func checkLeaks(t testing.TB) { leakcheck.Check(t) }

// segFiles lists the qvd segment files in dir.
func segFiles(t testing.TB, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "qvd-") {
			names = append(names, e.Name())
		}
	}
	return names
}

// dataHeader is a valid fp32 data frame header from src carrying n bytes (n % 4 == 0).
func dataHeader(src, n int) collective.Header {
	return collective.Header{Kind: collective.KindData, Op: collective.OpAllReduce, Src: uint16(src),
		Count: uint32(n / 4), Length: uint32(n)}
}

// fill writes a pattern determined by seed into b.
func fill(b []byte, seed uint64) {
	x := seed*0x9e3779b97f4a7c15 + 1
	for i := range b {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		b[i] = byte(x)
	}
}

func checkFill(b []byte, seed uint64) error {
	want := make([]byte, len(b))
	fill(want, seed)
	for i := range b {
		if b[i] != want[i] {
			return fmt.Errorf("byte %d of %d is %#x, want %#x (seed %d)", i, len(b), b[i], want[i], seed)
		}
	}
	return nil
}

// wantPeerErr checks that err is a *collective.PeerError naming rank and wrapping sentinel.
func wantPeerErr(t testing.TB, err error, rank int, sentinel error) {
	t.Helper()
	var pe *collective.PeerError
	if !errors.As(err, &pe) {
		t.Fatalf("error %v (%T) is not a *collective.PeerError", err, err)
	}
	if pe.Rank != rank {
		t.Fatalf("error names rank %d, want rank %d: %v", pe.Rank, rank, err)
	}
	if !errors.Is(err, sentinel) {
		t.Fatalf("error %v does not wrap %v", err, sentinel)
	}
}

// openFDs counts this process's open descriptors.
func openFDs(t testing.TB) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	return len(ents)
}

// mappedFrom counts this process's mappings of files under dir.
func mappedFrom(t testing.TB, dir string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Skipf("no /proc/self/maps: %v", err)
	}
	return strings.Count(string(b), dir+"/")
}
