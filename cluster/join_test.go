package cluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestJoinDuplicateName: a node named like a live member is refused at join, at once and
// naming the name, whichever member holds it; the holder stays a member (the refused node's
// departure is not taken for the holder's).
func TestJoinDuplicateName(t *testing.T) {
	checkLeaks(t)
	a := startNode(t, "a", RoleCoordinator)
	b := startNode(t, "b", RoleWorker)
	join(t, b, a)
	eventually(t, 3*time.Second, "a sees b", func() bool { return slices.Equal(memberNames(a.Members()), []string{"a", "b"}) })

	for _, dup := range []struct{ name, holder string }{{"b", b.LocalAddr()}, {"a", a.LocalAddr()}} {
		d := startNode(t, dup.name, RoleWorker)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		start := time.Now()
		err := d.Join(ctx, a.LocalAddr())
		cancel()
		if !errors.Is(err, ErrNameTaken) || Retryable(err) {
			t.Fatalf("second node named %q: got %v (retryable %v), want ErrNameTaken, final", dup.name, err, Retryable(err))
		}
		if want := fmt.Sprintf("node name %q is already taken by a", dup.name); !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), dup.holder) {
			t.Errorf("error %q should say %q and name the holder's address %s", err, want, dup.holder)
		}
		if took := time.Since(start); took > 3*time.Second {
			t.Errorf("refused after %v, want at once", took)
		}
		t.Logf("joiner: %v", err)
		if err := d.Close(); err != nil {
			t.Logf("close: %v", err)
		}
	}
	// The holders are untouched: nobody reports them gone, and they keep their addresses.
	time.Sleep(time.Second)
	if a.events.has(Left, "b") || a.events.has(Failed, "b") {
		t.Errorf("a lost b when b's namesake was refused:\n%s", a.events)
	}
	if b.events.has(Left, "a") || b.events.has(Failed, "a") {
		t.Errorf("b lost a when a's namesake was refused:\n%s", b.events)
	}
	for _, m := range a.Members() {
		if m.Name == "b" && m.Addr != b.LocalAddr() {
			t.Errorf("a has b at %s, want %s", m.Addr, b.LocalAddr())
		}
	}
	if len(a.logs.FilterMessage("refusing node").All()) == 0 {
		t.Errorf("a did not log the refusal")
	}
}

// TestJoinNotQVD: a peer that answers, but not with qvd's gossip, fails the join at once
// with ErrNotQVD naming it; a port nobody listens on stays retryable (a peer may be starting).
func TestJoinNotQVD(t *testing.T) {
	checkLeaks(t)
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "hello") }))
	defer web.Close()
	// Answers a line of text to whatever it receives, as SMTP or Redis would.
	talker := serveTCP(t, func(c net.Conn) {
		_, _ = bufio.NewReader(c).ReadByte()
		_, _ = io.WriteString(c, "-ERR unknown command\r\n")
	})
	// Reads a little and hangs up without a word (Python's http.server does this).
	hangup := serveTCP(t, func(c net.Conn) {
		_, _ = c.Read(make([]byte, 16))
	})
	refused := serveTCP(t, nil) // closed at once: nobody listens there

	n := startNode(t, "w", RoleWorker)
	for _, c := range []struct {
		what, peer string
		want       error
	}{
		{"an HTTP server", strings.TrimPrefix(web.URL, "http://"), ErrNotQVD},
		{"a text protocol", talker, ErrNotQVD},
		{"a silent hang-up", hangup, ErrNotQVD},
		{"no listener", refused, ErrJoin},
	} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		start := time.Now()
		err := n.Join(ctx, c.peer)
		cancel()
		took := time.Since(start)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: got %v, want %v", c.what, err, c.want)
			continue
		}
		if c.want == ErrNotQVD {
			if Retryable(err) || !strings.Contains(err.Error(), c.peer+" is not a qvd node") || took > 3*time.Second {
				t.Errorf("%s: %v after %v (retryable %v): want a final error naming %s, at once", c.what, err, took, Retryable(err), c.peer)
			}
		} else if !Retryable(err) {
			t.Errorf("%s: %v should be retryable", c.what, err)
		}
		t.Logf("%s: %v (%v)", c.what, err, took.Round(time.Millisecond))
	}
}

// serveTCP listens on 127.0.0.1 and runs handle on each connection, then closes it; with a
// nil handle it closes the listener at once and returns its (now refusing) address.
func serveTCP(t *testing.T, handle func(net.Conn)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	if handle == nil {
		l.Close()
		return addr
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			handle(c)
			c.Close()
		}
	}()
	t.Cleanup(func() { l.Close(); <-done })
	return addr
}

func TestRetryable(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("join x: %w: dial tcp: connection refused", ErrJoin), true},
		{fmt.Errorf("join x: %w", context.DeadlineExceeded), true},
		{fmt.Errorf("join x: %w", ErrKeyMismatch), false},
		{fmt.Errorf("join x: %w", ErrIncompatibleVersion), false},
		{fmt.Errorf("join x: %w", ErrTLSMismatch), false},
		{fmt.Errorf("join x: %w", ErrNameTaken), false},
		{fmt.Errorf("join x: %w", ErrNotQVD), false},
		{fmt.Errorf("join x: %w", context.Canceled), false},
		{nil, false},
	} {
		if got := Retryable(c.err); got != c.want {
			t.Errorf("Retryable(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
