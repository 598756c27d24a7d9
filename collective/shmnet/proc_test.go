//go:build linux

package shmnet

import (
	"bufio"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
)

// The multi-process tests run this test binary again as the ranks: TestMain sees childEnv
// and runs childMain instead of the tests. The child reads its part from the environment
// (test code only; the package itself never does) and reports on stdout, one line per event.
const childEnv = "QVD_SHMNET_TEST_CHILD"

func TestMain(m *testing.M) {
	if mode := os.Getenv(childEnv); mode != "" {
		os.Exit(childMain(mode))
	}
	os.Exit(m.Run())
}

// childMain is one rank: attach, run all-reduces checking every result exactly, and say
// "READY" after the first. Mode "allreduce" stops after QVD_ITERS calls, closes and reports
// its descriptors and mappings ("DONE fds=<before>/<after> maps=<n>"); mode "loop" runs until
// a call fails and reports it ("FAIL rank=<r> gone=<bool> at=<unix ns> err=<text>").
func childMain(mode string) int {
	dir := os.Getenv("QVD_DIR")
	rank, _ := strconv.Atoi(os.Getenv("QVD_RANK"))
	size, _ := strconv.Atoi(os.Getenv("QVD_SIZE"))
	iters, _ := strconv.Atoi(os.Getenv("QVD_ITERS"))
	secret, _ := hex.DecodeString(os.Getenv("QVD_SECRET"))
	// The runtime opens its poller's descriptors (epoll, eventfd) on the first timer: start
	// it before counting.
	<-time.After(time.Millisecond)
	_, _ = os.ReadDir("/proc/self/fd")
	fds0 := countFDs()
	cfg := DefaultConfig()
	cfg.RingBytes = 1 << 20
	cfg.AttachTimeout = 20 * time.Second
	ctx := context.Background()
	tr, err := New(ctx, Group{Job: "proc", Rank: rank, Size: size, Secret: secret, Dir: dir}, cfg, nil)
	if err != nil {
		fmt.Println("ERROR", err)
		return 2
	}
	ring, err := collective.NewRing(tr, collective.Config{Transport: "tcp", Timeout: 30 * time.Second, ChunkBytes: 256 << 10})
	if err != nil {
		fmt.Println("ERROR", err)
		return 2
	}
	buf := make([]float32, 3<<20/4+5) // 3 MiB: wraps the 1 MiB rings
	free := func() {}
	if os.Getenv("QVD_SHARED") != "" { // the direct path: a buffer in the shared arena
		if buf, err = ring.AllocShared(len(buf)); err != nil {
			fmt.Println("ERROR", err)
			return 2
		}
		b := buf
		free = func() { _ = ring.FreeShared(b) }
	}
	sum := float32(size * (size + 1) / 2)
	for iter := 0; mode != "allreduce" || iter < iters; iter++ {
		for i := range buf {
			buf[i] = float32(rank+1) * float32(i%5+iter%3)
		}
		if err := ring.AllReduce(ctx, buf, collective.Sum, collective.Call{}); err != nil {
			at := time.Now().UnixNano()
			var pe *collective.PeerError
			r := -1
			if errors.As(err, &pe) {
				r = pe.Rank
			}
			// Close as the trainer would: the Ring first sends the abort naming the culprit.
			free()
			_ = ring.Close()
			_ = tr.Close()
			fmt.Printf("FAIL rank=%d gone=%v at=%d err=%s\n", r, errors.Is(err, collective.ErrPeerGone), at, strings.ReplaceAll(err.Error(), "\n", " "))
			return 3
		}
		for i, v := range buf {
			if want := sum * float32(i%5+iter%3); v != want {
				fmt.Printf("ERROR iteration %d element %d is %v, want %v\n", iter, i, v, want)
				return 4
			}
		}
		if iter == 0 {
			fmt.Printf("READY pid=%d\n", os.Getpid())
		}
	}
	free()
	_ = ring.Close()
	_ = tr.Close()
	maps, _ := os.ReadFile("/proc/self/maps")
	fmt.Printf("DONE fds=%d/%d maps=%d\n", fds0, countFDs(), strings.Count(string(maps), dir+"/"))
	return 0
}

func countFDs() int {
	ents, _ := os.ReadDir("/proc/self/fd")
	return len(ents)
}

// child is a running rank and its stdout lines.
type child struct {
	cmd   *exec.Cmd
	lines chan string
}

func startChild(t *testing.T, mode, dir string, rank, size, iters int, secret []byte) *child {
	t.Helper()
	return startChildNS(t, mode, dir, rank, size, iters, secret, false)
}

// startChildNS is startChild, in a pid namespace of its own if newPidNS (where it is pid 1,
// as a container's entry point is); it skips the test where that cannot be done (not root).
func startChildNS(t *testing.T, mode, dir string, rank, size, iters int, secret []byte, newPidNS bool) *child {
	t.Helper()
	return startChildEnv(t, mode, dir, rank, size, iters, secret, newPidNS, false)
}

// startChildEnv is startChildNS, with the all-reduces on a buffer from the shared arena (the
// direct path) if shared.
func startChildEnv(t *testing.T, mode, dir string, rank, size, iters int, secret []byte, newPidNS, shared bool) *child {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	if newPidNS {
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	}
	cmd.Env = append(os.Environ(), childEnv+"="+mode, "QVD_DIR="+dir, "QVD_RANK="+strconv.Itoa(rank),
		"QVD_SIZE="+strconv.Itoa(size), "QVD_ITERS="+strconv.Itoa(iters), "QVD_SECRET="+hex.EncodeToString(secret))
	if shared {
		cmd.Env = append(cmd.Env, "QVD_SHARED=1")
	}
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		if newPidNS && (errors.Is(err, syscall.EPERM) || errors.Is(err, syscall.EINVAL)) {
			t.Skipf("cannot start a process in a new pid namespace: %v", err)
		}
		t.Fatal(err)
	}
	c := &child{cmd: cmd, lines: make(chan string, 16)}
	go func() { // ends when the child's stdout closes, that is when it exits
		defer close(c.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		for range c.lines {
		}
		_ = cmd.Wait()
	})
	return c
}

// line waits for the child's next line with the given prefix, failing on anything else that
// looks like an error, on exit, or after d.
func (c *child) line(t *testing.T, rank int, prefix string, d time.Duration) string {
	t.Helper()
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case l, ok := <-c.lines:
			if !ok {
				t.Fatalf("rank %d exited before saying %s", rank, prefix)
			}
			if strings.HasPrefix(l, prefix) {
				return l
			}
			if strings.HasPrefix(l, "ERROR") || strings.HasPrefix(l, "FAIL") {
				t.Fatalf("rank %d: %s", rank, l)
			}
		case <-timer.C:
			t.Fatalf("rank %d said no %s within %v", rank, prefix, d)
		}
	}
}

func procTimeout() time.Duration {
	if testing.Short() {
		return 30 * time.Second
	}
	return 60 * time.Second
}

// TestProcesses: real processes form a group in a directory, all-reduce and check the
// results, and leave no file, descriptor or mapping behind.
func TestProcesses(t *testing.T) {
	t.Run("rings", func(t *testing.T) { testProcesses(t, false) })
	t.Run("shared buffers", func(t *testing.T) { testProcesses(t, true) })
}

func testProcesses(t *testing.T, shared bool) {
	const n = 3
	dir, secret := t.TempDir(), newSecret(t)
	cs := make([]*child, n)
	for r := range cs {
		cs[r] = startChildEnv(t, "allreduce", dir, r, n, 20, secret, false, shared)
	}
	for r, c := range cs {
		l := c.line(t, r, "DONE", procTimeout())
		var before, after, maps int
		if _, err := fmt.Sscanf(l, "DONE fds=%d/%d maps=%d", &before, &after, &maps); err != nil {
			t.Fatalf("rank %d: %q: %v", r, l, err)
		}
		if before != after || maps != 0 {
			t.Errorf("rank %d after Close: %d descriptors (%d before New), %d mappings of %s", r, after, before, maps, dir)
		}
	}
	if left := segFiles(t, dir); len(left) != 0 {
		t.Fatalf("segment files left: %v", left)
	}
}

// TestProcessKilled: SIGKILL one of four ranks in the middle of all-reduces; the others'
// calls fail within a couple of seconds with errors naming it (the collective timeout is
// 30 s, so only the segment lock's probe can explain it), and nothing is left in the directory.
// With shared buffers (the direct path) every survivor waits on the victim at some step, or
// on a survivor that gave up blaming it, and names it through the victim's segment lock.
func TestProcessKilled(t *testing.T) {
	t.Run("rings", func(t *testing.T) { testProcessKilled(t, false) })
	t.Run("shared buffers", func(t *testing.T) { testProcessKilled(t, true) })
}

func testProcessKilled(t *testing.T, shared bool) {
	n, victim := 4, 2
	if testing.Short() {
		n, victim = 3, 1
	}
	dir, secret := t.TempDir(), newSecret(t)
	cs := make([]*child, n)
	for r := range cs {
		cs[r] = startChildEnv(t, "loop", dir, r, n, 0, secret, false, shared)
	}
	for r, c := range cs {
		c.line(t, r, "READY", procTimeout())
	}
	time.Sleep(20 * time.Millisecond)
	killAndExpectBlame(t, cs, victim, dir)
}

// TestPidNamespaces: ranks in pid namespaces of their own, each pid 1 as in containers
// that share an IPC namespace but not a pid namespace (docker-compose's ipc: service:...),
// attach and all-reduce with a rank in this namespace; when one of them is killed, the
// others report it within a couple of seconds, by rank. Watching pids could not work here:
// every such rank would "watch" pid 1 and so never see the death.
func TestPidNamespaces(t *testing.T) {
	const n, victim = 3, 1
	dir, secret := t.TempDir(), newSecret(t)
	cs := make([]*child, n)
	for r := range cs {
		cs[r] = startChildNS(t, "loop", dir, r, n, 0, secret, r > 0)
	}
	for r, c := range cs {
		l := c.line(t, r, "READY", procTimeout())
		var pid int
		if _, err := fmt.Sscanf(l, "READY pid=%d", &pid); err != nil {
			t.Fatalf("rank %d: %q: %v", r, l, err)
		}
		if r > 0 && pid != 1 {
			t.Fatalf("rank %d runs as pid %d in its namespace, want 1", r, pid)
		}
	}
	killAndExpectBlame(t, cs, victim, dir)
}

// TestKilledWhileAttaching: a rank killed while its segment still has a name (waiting for a
// peer that never comes) leaves the file; the next New in that directory removes it. In a
// pid namespace of its own the dead rank was pid 1, a pid that is always alive here: only
// the segment's lock can tell that its creator is gone.
func TestKilledWhileAttaching(t *testing.T) {
	t.Run("same pid namespace", func(t *testing.T) { testKilledWhileAttaching(t, false) })
	t.Run("own pid namespace", func(t *testing.T) { testKilledWhileAttaching(t, true) })
}

func testKilledWhileAttaching(t *testing.T, newPidNS bool) {
	dir, secret := t.TempDir(), newSecret(t)
	c := startChildNS(t, "allreduce", dir, 0, 2, 1, secret, newPidNS)
	deadline := time.Now().Add(procTimeout())
	for len(segFiles(t, dir)) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the child's segment never appeared")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := c.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for range c.lines {
	}
	_ = c.cmd.Wait()
	left := segFiles(t, dir)
	if len(left) != 1 {
		t.Fatalf("after the kill: %v, want the orphaned segment", left)
	}
	if newPidNS && !strings.HasSuffix(left[0], "-1") {
		t.Fatalf("the orphan %s is not named after pid 1: the child did not run in its own pid namespace", left[0])
	}
	tr, err := New(context.Background(), Group{Job: "next", Rank: 0, Size: 1, Secret: secret, Dir: dir}, testConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	_ = tr.Close()
	if _, err := os.Stat(filepath.Join(dir, left[0])); !os.IsNotExist(err) {
		t.Fatalf("the orphan %s survived the next New: %v", left[0], err)
	}
}

// killAndExpectBlame SIGKILLs the running child victim; every other child must fail within
// 3 s blaming it (its successor with ErrPeerGone), and no segment file may be left in dir.
func killAndExpectBlame(t *testing.T, cs []*child, victim int, dir string) {
	t.Helper()
	n := len(cs)
	killed := time.Now()
	if err := cs[victim].cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	for r, c := range cs {
		if r == victim {
			continue
		}
		l := c.line(t, r, "FAIL", 20*time.Second)
		var rank int
		var gone bool
		var at int64
		if _, err := fmt.Sscanf(l, "FAIL rank=%d gone=%t at=%d", &rank, &gone, &at); err != nil {
			t.Fatalf("rank %d: %q: %v", r, l, err)
		}
		if rank != victim {
			t.Errorf("rank %d blames rank %d, want the killed rank %d: %s", r, rank, victim, l)
		}
		if el := time.Unix(0, at).Sub(killed); el > 3*time.Second {
			t.Errorf("rank %d noticed the kill after %v: %s", r, el, l)
		}
		if r == (victim+1)%n && !gone {
			t.Errorf("rank %d, the killed rank's successor, should report ErrPeerGone: %s", r, l)
		}
	}
	if left := segFiles(t, dir); len(left) != 0 {
		t.Fatalf("segment files left: %v", left)
	}
}
