package grpcnet

import (
	"context"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/pki"
)

func tlsIdentity(t testing.TB, ca *pki.CA) *cluster.TLS {
	t.Helper()
	cert, key, err := ca.Issue([]string{"127.0.0.1"}, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	id, err := cluster.NewTLS(ca.CertPEM, cert, key)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// tlsGroup makes the transports of job on nodes, dialling with opts.
func tlsGroup(t testing.TB, job string, secret []byte, nodes []*node, opts []grpc.DialOption) []*transport {
	t.Helper()
	addrs := []string{nodes[0].addr, nodes[1].addr}
	out := make([]*transport, len(nodes))
	for r, n := range nodes {
		tr, err := n.hub.Transport(context.Background(), Group{Roster: collective.Roster{Job: job, Rank: r, Addrs: addrs, Secret: secret}, DialOptions: opts})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = tr.Close() })
		out[r] = tr.(*transport)
	}
	return out
}

// openStream opens a frame stream to addr for job as cmd/qvd's servers see it, with opts
// after the transport's own DialOptions.
func openStream(t *testing.T, ctx context.Context, addr, job string, opts ...grpc.DialOption) (grpc.ClientStream, error) {
	t.Helper()
	cc, err := grpc.NewClient("passthrough:///"+addr, append(DialOptions(), opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	ctx = metadata.AppendToOutgoingContext(ctx, jobKey, job)
	return cc.NewStream(ctx, &framesDesc.Streams[0], fullMethod, grpc.ForceCodecV2(frameCodec{}))
}

// TestTLSFrameStreams: with the servers cmd/qvd builds (mutual TLS and the cluster key),
// ranks exchange frames; a client without TLS, with a certificate from another CA, or with
// the right certificate but no cluster key cannot open a frame stream; and a peer holding
// every credential that sends a malformed frame fails only its own link.
func TestTLSFrameStreams(t *testing.T) {
	leakCheck(t)
	caA, caB := mustCA(t), mustCA(t)
	idA, idB := tlsIdentity(t, caA), tlsIdentity(t, caB)
	key, _ := hex.DecodeString("bde22900e1b7eb95844631756a8f5c39eec392e3b79a2d31dac777fce2017365") // a random key: cluster.ValidateKey refuses patterned ones
	nodes := tcpNodes(t, testTuning(), 2, cluster.ServerOptions(key, idA, nil)...)
	ctx := ctxFor(t, 20*time.Second)
	secret := []byte("tls test secret")
	creds := cluster.DialOptions(key, idA)
	tr := tlsGroup(t, "job", secret, nodes, creds)
	exchange(t, ctx, tr, 0, 1, 1<<16, 1)
	exchange(t, ctx, tr, 1, 0, 1<<16, 2)

	for _, c := range []struct {
		name string
		opts []grpc.DialOption
		code codes.Code
	}{
		{"no credentials (plain TCP)", nil, codes.Unavailable},
		{"the cluster key over plain TCP", cluster.DialOptions(key, nil), codes.Unavailable},
		{"certificate from another CA", cluster.DialOptions(key, idB), codes.Unavailable},
		{"the cluster's certificate, no key", []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tlsIdentity(t, caA).ClientConfig()))}, codes.Unauthenticated},
	} {
		cs, err := openStream(t, ctx, nodes[1].addr, "job", c.opts...)
		if err == nil {
			_ = cs.SendMsg(helloOf(0, 2, "job", secret))
			err = streamStatus(cs)
		}
		if status.Code(err) != c.code {
			t.Fatalf("%s: stream ended with %v, want %v", c.name, err, c.code)
		}
		t.Logf("%s: %v", c.name, err)
	}

	// An authenticated peer's malformed frame.
	tr2 := tlsGroup(t, "job2", secret, nodes, creds)
	cs, err := openStream(t, ctx, nodes[1].addr, "job2", creds...)
	if err != nil {
		t.Fatal(err)
	}
	if err := cs.SendMsg(helloOf(0, 2, "job2", secret)); err != nil {
		t.Fatal(err)
	}
	ans := new(inFrame)
	if err := cs.RecvMsg(ans); err != nil || ans.hdr.Kind != collective.KindHello {
		t.Fatalf("no answering hello: %v", err)
	}
	ans.release()
	bad := newRawFrame(dataHeader(0, 16, 1, 1), make([]byte, 16))
	bad.b[0] ^= 0xff
	_ = cs.SendMsg(bad)
	_, _, err = tr2[1].Recv(ctx, 0, make([]byte, 64))
	isPeerErr(t, err, 0, collective.ErrProtocol)
	if !strings.Contains(err.Error(), "magic") {
		t.Fatalf("error %q does not name the bad magic", err)
	}
	if st := streamStatus(cs); status.Code(st) != codes.InvalidArgument {
		t.Fatalf("the sender's stream ended with %v, want InvalidArgument", st)
	}
	// The receiver is unharmed: the first job's links still carry frames.
	exchange(t, ctx, tr, 0, 1, 1<<10, 3)
}

func mustCA(t testing.TB) *pki.CA {
	t.Helper()
	ca, err := pki.NewCA(time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return ca
}
