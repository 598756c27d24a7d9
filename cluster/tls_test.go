package cluster

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/qvd/qvd/internal/pki"
)

func withTLS(id *TLS) nodeOpt { return func(c *Config, _ *Meta) { c.TLS = id } }

func newCA(t testing.TB) *pki.CA {
	t.Helper()
	ca, err := pki.NewCA(time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// issue returns a node identity under ca, and its PEM files.
func issue(t testing.TB, ca *pki.CA) (*TLS, []byte, []byte) {
	t.Helper()
	cert, key, err := ca.Issue([]string{"127.0.0.1", "localhost"}, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	id, err := NewTLS(ca.CertPEM, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	return id, cert, key
}

// intruder returns an identity whose certificate caB signed but that trusts caA too, so
// that it is the server's refusal of its certificate, not its own of the server's, that a
// test sees.
func intruder(t testing.TB, caA, caB *pki.CA) *TLS {
	t.Helper()
	_, cert, key := issue(t, caB)
	id, err := NewTLS(append(append([]byte(nil), caA.CertPEM...), caB.CertPEM...), cert, key)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestTLSConfigErrors: each way the files can be wrong is an error naming the field and
// the file.
func TestTLSConfigErrors(t *testing.T) {
	dir := t.TempDir()
	caA, caB := newCA(t), newCA(t)
	_, certA, keyA := issue(t, caA)
	_, certB, keyB := issue(t, caB)
	expired, expiredKey, err := caA.Issue([]string{"old"}, time.Minute, time.Now().Add(-2*time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	ca, cert, key := write("ca.pem", caA.CertPEM), write("node.pem", certA), write("node-key.pem", keyA)
	bCert, bKey := write("b.pem", certB), write("b-key.pem", keyB)
	noCerts := write("empty.pem", []byte("not a certificate\n"))
	old, oldKey := write("old.pem", expired), write("old-key.pem", expiredKey)
	missing := filepath.Join(dir, "missing.pem")

	if id, err := (TLSConfig{}).Load(nil); id != nil || err != nil {
		t.Fatalf("no files: %v, %v; want no TLS", id, err)
	}
	id, err := TLSConfig{CA: ca, Cert: cert, Key: key}.Load(nil)
	if err != nil || id.Fingerprint() == "" {
		t.Fatalf("good files: %v", err)
	}
	for _, c := range []struct {
		name string
		cfg  TLSConfig
		want []string
	}{
		{"cert and key missing", TLSConfig{CA: ca}, []string{"cert: missing", "given: ca"}},
		{"ca missing", TLSConfig{Cert: cert, Key: key}, []string{"ca: missing"}},
		{"unreadable ca", TLSConfig{CA: missing, Cert: cert, Key: key}, []string{"ca: ", missing, "no such file"}},
		{"unreadable key", TLSConfig{CA: ca, Cert: cert, Key: missing}, []string{"key: ", missing}},
		{"ca without certificates", TLSConfig{CA: noCerts, Cert: cert, Key: key}, []string{"ca: ", noCerts, "no PEM certificate"}},
		{"cert without certificates", TLSConfig{CA: ca, Cert: noCerts, Key: key}, []string{"cert: ", noCerts, "no PEM certificate"}},
		{"key of another certificate", TLSConfig{CA: ca, Cert: cert, Key: bKey}, []string{"key: ", bKey, "does not go with", cert}},
		{"certificate of another CA", TLSConfig{CA: ca, Cert: bCert, Key: bKey}, []string{"cert: ", bCert, "not valid under the CA in " + ca, "unknown authority"}},
		{"expired certificate", TLSConfig{CA: ca, Cert: old, Key: oldKey}, []string{"cert: ", old, "expired"}},
	} {
		err := c.cfg.Validate()
		if err == nil || !errors.Is(err, ErrConfig) {
			t.Errorf("%s: got %v, want a config error", c.name, err)
			continue
		}
		for _, w := range c.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: %q does not mention %q", c.name, err, w)
			}
		}
	}
}

// TestTLSControlService: with mutual TLS, the control service refuses a client without
// TLS, a client whose certificate another CA signed, and a client with the right certificate
// but without the cluster key; a client with both is served.
func TestTLSControlService(t *testing.T) {
	checkLeaks(t)
	caA, caB := newCA(t), newCA(t)
	idA, _, _ := issue(t, caA)
	idA2, _, _ := issue(t, caA)
	idB, _, _ := issue(t, caB)
	w := startNode(t, "w", RoleWorker, withTLS(idA))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr := w.LocalMeta().GRPC
	good := rosterFor(t, testKey, "job", 10, w)

	for _, c := range []struct {
		name string
		opts []grpc.DialOption
		code codes.Code
	}{
		{"plain TCP, no credentials", []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, codes.Unavailable},
		{"plain TCP with the key", DialOptions(testKey, nil), codes.Unavailable},
		{"certificate from another CA, with the key", DialOptions(testKey, idB), codes.Unavailable},
		{"certificate from another CA, trusting the server", DialOptions(testKey, intruder(t, caA, caB)), codes.Unavailable},
		{"the cluster's certificate, no key", []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(idA2.ClientConfig()))}, codes.Unauthenticated},
		{"the cluster's certificate, another key", DialOptions(otherKey, idA2), codes.Unauthenticated},
	} {
		// Not callPrepare: its WaitForReady would wait out a refused handshake.
		err := dial(t, addr, c.opts...).Invoke(ctx, methodPrepare, good, new(ackMsg), grpc.CallContentSubtype(codecName))
		wantCode(t, c.name, err, c.code)
	}
	if _, err := callPrepare(ctx, dial(t, addr, DialOptions(testKey, idA2)...), good); err != nil {
		t.Fatalf("certificate and key: %v", err)
	}
}

// TestTLSJoin: a node whose TLS uses another CA, or that has no TLS, is refused at join
// with ErrTLSMismatch; a node of the cluster's CA joins and takes part in a rendezvous
// carried over mutual TLS.
func TestTLSJoin(t *testing.T) {
	checkLeaks(t)
	caA, caB := newCA(t), newCA(t)
	idA, _, _ := issue(t, caA)
	idA2, _, _ := issue(t, caA)
	idB, _, _ := issue(t, caB)
	coord := startNode(t, "coord", RoleCoordinator, withTLS(idA))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()

	for _, c := range []struct {
		name string
		opts []nodeOpt
		want string
	}{
		{"wb", []nodeOpt{withTLS(idB)}, "uses mutual TLS with CA " + idA.Fingerprint() + ", this node uses mutual TLS with CA " + idB.Fingerprint()},
		{"wn", nil, "uses mutual TLS with CA " + idA.Fingerprint() + ", this node uses no TLS"},
	} {
		n := startNode(t, c.name, RoleWorker, c.opts...)
		err := n.Join(ctx, coord.LocalAddr())
		if !errors.Is(err, ErrTLSMismatch) || !strings.Contains(err.Error(), c.want) {
			t.Fatalf("%s: join: %v, want ErrTLSMismatch saying %q", c.name, err, c.want)
		}
		t.Logf("%s: %v", c.name, err)
	}

	w := startNode(t, "w", RoleWorker, withTLS(idA2))
	if err := w.Join(ctx, coord.LocalAddr()); err != nil {
		t.Fatalf("join with the cluster's CA: %v", err)
	}
	got := make(chan *Roster, 1)
	go func() {
		r, err := w.AwaitRoster(ctx)
		if err != nil {
			t.Errorf("await roster: %v", err)
		}
		got <- r
	}()
	if _, err := coord.Coordinate(ctx, "job", 2, []byte("config")); err != nil {
		t.Fatalf("coordinate over mutual TLS: %v", err)
	}
	if r := <-got; r == nil || r.Rank != 1 || string(r.Config) != "config" {
		t.Fatalf("worker's roster: %+v", r)
	}
	for _, m := range coord.Members() {
		if m.Name == "wb" || m.Name == "wn" {
			t.Fatalf("refused node %s is a member", m.Name)
		}
	}
}

// TestTLSForgedFingerprint: a node that holds the cluster key and claims the cluster's CA
// in its metadata, but whose certificate another CA signed, gets into the gossip (the
// fingerprint is a consistency check, not a credential) but no further: the coordinator's
// rendezvous cannot hand it a roster, and it cannot call the control service.
func TestTLSForgedFingerprint(t *testing.T) {
	checkLeaks(t)
	caA, caB := newCA(t), newCA(t)
	idA, _, _ := issue(t, caA)
	forged := intruder(t, caA, caB)
	forged.fingerprint = idA.Fingerprint()
	coord := startNode(t, "coord", RoleCoordinator, withTLS(idA), withRendezvous(2*time.Second))
	rogue := startNode(t, "rogue", RoleWorker, withTLS(forged))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := rogue.Join(ctx, coord.LocalAddr()); err != nil {
		t.Fatalf("gossip join: %v", err)
	}
	_, err := coord.Coordinate(ctx, "job", 2, nil)
	if !errors.Is(err, ErrRendezvousTimeout) || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("coordinate with the rogue: %v, want a timeout naming a certificate failure", err)
	}
	t.Logf("coordinate: %v", err)
	err = dial(t, coord.LocalMeta().GRPC, DialOptions(testKey, forged)...).Invoke(ctx, methodPrepare,
		rosterFor(t, testKey, "job", 1, rogue), new(ackMsg), grpc.CallContentSubtype(codecName))
	wantCode(t, "the rogue calls the control service", err, codes.Unavailable)
}
