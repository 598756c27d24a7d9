package tcpnet

import (
	"crypto/tls"
	"errors"
	"net"
	"strings"
	"testing"
	"time"

	qvdcluster "github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/pki"
)

// identity makes a node identity under ca, as `qvd certs` would.
func identity(t testing.TB, ca *pki.CA, alsoTrust ...*pki.CA) *qvdcluster.TLS {
	t.Helper()
	cert, key, err := ca.Issue([]string{"127.0.0.1"}, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	roots := append([]byte(nil), ca.CertPEM...)
	for _, o := range alsoTrust {
		roots = append(roots, o.CertPEM...)
	}
	id, err := qvdcluster.NewTLS(roots, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func newTestCA(t testing.TB) *pki.CA {
	t.Helper()
	ca, err := pki.NewCA(time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

func tlsConfig(id *qvdcluster.TLS) Config {
	c := testConfig()
	c.TLS = &TLS{Server: id.ServerConfig(), Client: id.ClientConfig()}
	return c
}

// TestTLSRing: the ring all-reduce runs over mutual-TLS data connections.
func TestTLSRing(t *testing.T) {
	checkLeaks(t)
	const n, length = 3, 100_003
	c := newCluster(t, n, tlsConfig(identity(t, newTestCA(t))))
	rs := rings(t, c, 16<<10)
	ctx := ctxTimeout(t, 30*time.Second)
	bufs := make([][]float32, n)
	for r := range bufs {
		bufs[r] = make([]float32, length)
		for i := range bufs[r] {
			bufs[r][i] = float32(r + i%7)
		}
	}
	if err := onAll(n, func(r int) error { return rs[r].AllReduce(ctx, bufs[r], collective.Sum, collective.Call{}) }); err != nil {
		t.Fatal(err)
	}
	for r := range bufs {
		for i, v := range bufs[r] {
			if want := float32(0+1+2) + 3*float32(i%7); v != want {
				t.Fatalf("rank %d element %d: %v, want %v", r, i, v, want)
			}
		}
	}
}

// TestTLSRefusesStrangers: a listener with TLS refuses a dialler with a certificate from
// another CA (the dialler's Send fails at once with ErrAuth, not after DialTimeout), a plain
// TCP peer that knows the job's secret, and keeps serving its own ranks.
func TestTLSRefusesStrangers(t *testing.T) {
	checkLeaks(t)
	caA, caB := newTestCA(t), newTestCA(t)
	c := newCluster(t, 2, tlsConfig(identity(t, caA)))
	ctx := ctxTimeout(t, 20*time.Second)

	for _, s := range []struct {
		name string
		id   *qvdcluster.TLS
	}{
		{"another CA", identity(t, caB)},
		{"another CA, trusting ours", identity(t, caB, caA)}, // the listener's refusal, not the dialler's
	} {
		lns, _ := listeners(t, 1, tlsConfig(s.id))
		tr, err := lns[0].Transport(ctx, Group{Job: c.job, Rank: 0, Addrs: []string{lns[0].Addr(), c.lns[1].Addr()}, Secret: c.secret})
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		err = tr.Send(ctx, 1, dataHeader(0, 8), make([]byte, 8))
		if !errors.Is(err, collective.ErrAuth) || time.Since(start) > testConfig().DialTimeout/2 {
			t.Fatalf("%s: send: %v after %v, want ErrAuth at once", s.name, err, time.Since(start))
		}
		t.Logf("%s: %v", s.name, err)
		_ = tr.Close()
	}

	// A plain TCP peer with the job's secret gets no further than the TLS handshake.
	raw, err := net.Dial("tcp", c.lns[1].Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	_ = raw.SetDeadline(time.Now().Add(5 * time.Second))
	_ = writeHello(raw, c.secret, c.job, 0, 2)
	if _, _, err := readHello(raw); err == nil {
		t.Fatal("a plain TCP peer got an answering hello from a TLS listener")
	}

	// The cluster's own ranks still talk.
	payload := make([]byte, 64<<10)
	fill(payload, 3)
	go func() { _ = c.ts[0].Send(ctx, 1, dataHeader(0, len(payload)), payload) }()
	_, p, err := c.ts[1].Recv(ctx, 0, make([]byte, len(payload)))
	if err != nil || checkFill(p, 3) != nil {
		t.Fatalf("recv after the strangers: %v", err)
	}
}

// TestTLSMalformedFrame: a peer that holds a certificate of the cluster and the job's
// secret, and then sends a malformed frame, fails the receiver's Recv with ErrProtocol (after
// the good frame before it) and never crashes it; the listener keeps serving.
func TestTLSMalformedFrame(t *testing.T) {
	checkLeaks(t)
	ca := newTestCA(t)
	id := identity(t, ca)
	c := newCluster(t, 2, tlsConfig(id))
	ctx := ctxTimeout(t, 20*time.Second)

	for _, bad := range []struct {
		name  string
		frame []byte
		msg   string
	}{
		{"bad magic", func() []byte { b := rawFrame(dataHeader(0, 8), make([]byte, 8)); b[0] ^= 0xff; return b }(), "magic"},
		{"oversized", rawFrame(collective.Header{Kind: collective.KindAbort, Src: 0, Length: collective.MaxPayload + 1}, nil), "exceeds"},
		{"wrong sender", rawFrame(dataHeader(1, 8), make([]byte, 8)), "source rank 1"},
		{"hello again", rawFrame(collective.Header{Kind: collective.KindHello, Src: 0, Length: 4}, []byte("helo")), "kind"},
	} {
		t.Run(bad.name, func(t *testing.T) {
			job := "job-" + strings.ReplaceAll(bad.name, " ", "-")
			lns := c.lns
			var ts [2]collective.Transport
			for r := range ts {
				tr, err := lns[r].Transport(ctx, Group{Job: job, Rank: r, Addrs: addrs(lns), Secret: c.secret})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = tr.Close() })
				ts[r] = tr
			}
			conn, err := tls.Dial("tcp", lns[1].Addr(), id.ClientConfig())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
			if err := writeHello(conn, c.secret, job, 0, 2); err != nil {
				t.Fatal(err)
			}
			if _, _, err := readHello(conn); err != nil {
				t.Fatalf("authenticated peer: no answering hello: %v", err)
			}
			good := rawFrame(dataHeader(0, 8), []byte("goodgood"))
			if _, err := conn.Write(append(good, bad.frame...)); err != nil {
				t.Fatal(err)
			}
			buf := make([]byte, 64)
			if _, p, err := ts[1].Recv(ctx, 0, buf); err != nil || string(p) != "goodgood" {
				t.Fatalf("the good frame: %q, %v", p, err)
			}
			_, _, err = ts[1].Recv(ctx, 0, buf)
			wantPeerErr(t, err, 0, lns[0].Addr(), collective.ErrProtocol)
			if !strings.Contains(err.Error(), bad.msg) {
				t.Fatalf("error %q does not mention %q", err, bad.msg)
			}
			if err := waitClosed(conn); err != nil {
				t.Fatal(err)
			}
		})
	}
	// The listener and the first job are unharmed.
	go func() { _ = c.ts[0].Send(ctx, 1, dataHeader(0, 8), []byte("stillok!")) }()
	if _, p, err := c.ts[1].Recv(ctx, 0, make([]byte, 8)); err != nil || string(p) != "stillok!" {
		t.Fatalf("after the malformed frames: %q, %v", p, err)
	}
}
