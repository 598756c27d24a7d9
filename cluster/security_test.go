package cluster

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/status"

	"github.com/qvd/qvd/internal/lograte"
)

// TestTLSRefusesCAAsIdentity: the CA's certificate (and key) given as a node's identity is
// refused, with an error naming the cert field and file.
func TestTLSRefusesCAAsIdentity(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t)
	caFile := filepath.Join(dir, "ca.pem")
	caKey := filepath.Join(dir, "ca-key.pem")
	if err := os.WriteFile(caFile, ca.CertPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(caKey, ca.KeyPEM, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := TLSConfig{CA: caFile, Cert: caFile, Key: caKey}.Load(nil)
	if !errors.Is(err, ErrConfig) || !strings.HasPrefix(err.Error(), "cert: "+caFile) || !strings.Contains(err.Error(), "is a CA certificate") {
		t.Fatalf("CA as the node's certificate: got %v, want a cert error naming %s", err, caFile)
	}
	t.Log(err)
	if _, err := NewTLS(ca.CertPEM, ca.CertPEM, ca.KeyPEM); err == nil {
		t.Fatal("NewTLS accepted the CA as a node identity")
	}
}

// TestTLSRefusesLeafAsCA: a node certificate given as the CA is refused, with an error
// naming the ca field and file (Go's verifier would trust it as a root, admitting only
// itself).
func TestTLSRefusesLeafAsCA(t *testing.T) {
	dir := t.TempDir()
	ca := newCA(t)
	_, cert, key := issue(t, ca)
	certFile, keyFile := filepath.Join(dir, "node.pem"), filepath.Join(dir, "node-key.pem")
	if err := os.WriteFile(certFile, cert, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, key, 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := TLSConfig{CA: certFile, Cert: certFile, Key: keyFile}.Load(nil)
	if !errors.Is(err, ErrConfig) || !strings.HasPrefix(err.Error(), "ca: "+certFile) || !strings.Contains(err.Error(), "is not a CA certificate") {
		t.Fatalf("node certificate as the CA: got %v, want a ca error naming %s", err, certFile)
	}
	t.Log(err)
	// A CA file that holds the CA and, by mistake, a node certificate is refused too.
	if _, err := NewTLS(append(append([]byte(nil), ca.CertPEM...), cert...), cert, key); err == nil || !strings.Contains(err.Error(), "certificate 2") {
		t.Fatalf("CA file with a node certificate in it: %v", err)
	}
}

// serve runs srv on a loopback listener until the test ends.
func serve(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	t.Cleanup(func() { srv.Stop(); <-done })
	return lis.Addr().String()
}

// TestAuthRefusalLogged: refused gRPC calls are logged at WARN with the method and remote
// address, and a flood of them writes at most refusalBurst lines.
func TestAuthRefusalLogged(t *testing.T) {
	checkLeaks(t)
	core, logs := observer.New(zapcore.InfoLevel)
	srv := grpc.NewServer(ServerOptions(testKey, nil, zap.New(core))...)
	srv.RegisterService(&echoDesc, struct{}{})
	addr := serve(t, srv)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cc := dial(t, addr, DialOptions(otherKey, nil)...)
	const calls = 40
	for i := range calls {
		s, err := cc.NewStream(ctx, &echoDesc.Streams[0], "/test.Echo/Stream", grpc.CallContentSubtype(codecName))
		if err == nil {
			_ = s.SendMsg(map[string]string{"i": fmt.Sprint(i)})
			var out map[string]string
			err = s.RecvMsg(&out)
		}
		wantCodeQuiet(t, err, codes.Unauthenticated)
	}
	refused := logs.FilterMessage("refused a gRPC call").All()
	if len(refused) == 0 || len(refused) > refusalBurst {
		t.Fatalf("%d calls refused: %d log lines, want 1 to %d", calls, len(refused), refusalBurst)
	}
	e := refused[0]
	f := e.ContextMap()
	if e.Level != zapcore.WarnLevel || f["method"] != "/test.Echo/Stream" || !strings.HasPrefix(fmt.Sprint(f["remote_addr"]), "127.0.0.1:") ||
		!strings.Contains(fmt.Sprint(f["reason"]), "another cluster key") {
		t.Fatalf("refusal line: %v %v", e.Level, f)
	}
	// A caller with the key is served, and not logged.
	good := dial(t, addr, DialOptions(testKey, nil)...)
	s, err := good.NewStream(ctx, &echoDesc.Streams[0], "/test.Echo/Stream", grpc.CallContentSubtype(codecName))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.SendMsg(map[string]string{"hi": "there"}); err != nil {
		t.Fatal(err)
	}
	var out map[string]string
	if err := s.RecvMsg(&out); err != nil || out["hi"] != "there" {
		t.Fatalf("call with the key: %v %v", out, err)
	}
}

func wantCodeQuiet(t *testing.T, err error, code codes.Code) {
	t.Helper()
	if c := status.Code(err); c != code {
		t.Fatalf("got %v, want %v", err, code)
	}
}

// TestTLSHandshakeRefusalLogged: a connection that fails the server's TLS handshake (here,
// plain text to the TLS port) is logged at WARN with its address, at most refusalBurst
// lines for a flood; a connection closed before its first byte is not logged.
func TestTLSHandshakeRefusalLogged(t *testing.T) {
	checkLeaks(t)
	id, _, _ := issue(t, newCA(t))
	core, logs := observer.New(zapcore.InfoLevel)
	srv := grpc.NewServer(ServerOptions(testKey, id, zap.New(core))...)
	addr := serve(t, srv)

	probe := func(payload string) {
		c, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if payload != "" {
			_, _ = c.Write([]byte(payload))
		} else {
			_ = c.(*net.TCPConn).CloseWrite()
		}
		// The server closes the connection after the failed handshake, which it logs first.
		_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
		var b [512]byte
		for {
			if _, err := c.Read(b[:]); err != nil {
				return
			}
		}
	}
	probe("") // closed before any byte: not logged
	if n := logs.FilterMessage("refused a TLS handshake").Len(); n != 0 {
		t.Fatalf("an empty connection was logged: %v", logs.All())
	}
	const conns = 30
	for range conns {
		probe("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") // a gRPC client without TLS
	}
	lines := logs.FilterMessage("refused a TLS handshake").All()
	if len(lines) == 0 || len(lines) > refusalBurst {
		t.Fatalf("%d refused handshakes: %d log lines, want 1 to %d: %v", conns, len(lines), refusalBurst, logs.All())
	}
	if f := lines[0].ContextMap(); lines[0].Level != zapcore.WarnLevel || !strings.HasPrefix(fmt.Sprint(f["remote_addr"]), "127.0.0.1:") {
		t.Fatalf("handshake line: %v %v", lines[0].Level, f)
	}
	t.Logf("%s %v", lines[0].Message, lines[0].ContextMap())
}

// countCodec is a JSON-less codec that counts the request bodies it decodes.
type countCodec struct{}

var decodes atomic.Int64

const countCodecName = "qvd-count-test"

func (countCodec) Marshal(v any) ([]byte, error) { return v.([]byte), nil }
func (countCodec) Unmarshal(data []byte, v any) error {
	decodes.Add(1)
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (countCodec) Name() string { return countCodecName }

func init() { encoding.RegisterCodec(countCodec{}) }

// rawCodec is the client's: it sends a body as it is, under a server codec's name, and
// ignores the answer.
type rawCodec struct{ name string }

func (rawCodec) Marshal(v any) ([]byte, error)      { return v.([]byte), nil }
func (rawCodec) Unmarshal(data []byte, v any) error { return nil }
func (c rawCodec) Name() string                     { return c.name }

// sinkDesc is a unary service whose handler decodes the body before it runs interceptors,
// as protoc-generated handlers and the control service's do.
var sinkDesc = grpc.ServiceDesc{
	ServiceName: "test.Sink",
	HandlerType: (*echoServer)(nil),
	Methods: []grpc.MethodDesc{{MethodName: "Put", Handler: func(srv any, ctx context.Context, dec func(any) error, ic grpc.UnaryServerInterceptor) (any, error) {
		in := new([]byte)
		if err := dec(in); err != nil {
			return nil, err
		}
		h := func(context.Context, any) (any, error) { return []byte("ok"), nil }
		if ic == nil {
			return h(ctx, in)
		}
		return ic(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/test.Sink/Put"}, h)
	}}},
}

// TestBodyNotDecodedBeforeAuth: a call without valid credentials is refused before its
// body is read or decoded, however large or malformed the body; the control service
// answers such a call Unauthenticated, not with a decoding error; and a control message
// above maxControlMessage from a key holder is refused without decoding it.
func TestBodyNotDecodedBeforeAuth(t *testing.T) {
	checkLeaks(t)
	srv := grpc.NewServer(append(ServerOptions(testKey, nil, nil), grpc.MaxRecvMsgSize(64<<20))...)
	srv.RegisterService(&sinkDesc, struct{}{})
	w := &Node{} // the control service refuses before it touches the node
	srv.RegisterService(&controlServiceDesc, &controlHandler{n: w})
	addr := serve(t, srv)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	garbage := make([]byte, 3<<20)
	_, _ = rand.Read(garbage)
	put := func(cc *grpc.ClientConn, body []byte) error {
		var out []byte
		return cc.Invoke(ctx, "/test.Sink/Put", body, &out, grpc.ForceCodec(rawCodec{countCodecName}))
	}
	before := decodes.Load()
	for _, c := range []struct {
		name string
		opts []grpc.DialOption
	}{
		{"no credentials", []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}},
		{"another key", DialOptions(otherKey, nil)},
	} {
		cc := dial(t, addr, c.opts...)
		wantCode(t, c.name+", 3 MiB body", put(cc, garbage), codes.Unauthenticated)
		if n := decodes.Load() - before; n != 0 {
			t.Fatalf("%s: the server decoded %d bodies of refused calls", c.name, n)
		}
		// The control service: garbage JSON is not decoded, so the refusal is about the key.
		err := cc.Invoke(ctx, methodPrepare, garbage, new([]byte), grpc.ForceCodec(rawCodec{codecName}))
		wantCode(t, c.name+", garbage roster", err, codes.Unauthenticated)
	}
	cc := dial(t, addr, DialOptions(testKey, nil)...)
	if err := put(cc, []byte("hi")); err != nil || decodes.Load()-before != 1 {
		t.Fatalf("call with the key: %v, %d decodes", err, decodes.Load()-before)
	}
	huge := make([]byte, maxControlMessage+1)
	err := cc.Invoke(ctx, methodPrepare, huge, new([]byte), grpc.ForceCodec(rawCodec{codecName}))
	// gRPC reports a codec's refusal as Internal; the text says why.
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("limit %d", maxControlMessage)) {
		t.Fatalf("key holder, oversized roster: got %v, want the size limit", err)
	}
}

// TestGossipGarbageFlood: garbage datagrams sent to the gossip port write a bounded number
// of log lines (not one each), and the next line allowed says how many were left out.
func TestGossipGarbageFlood(t *testing.T) {
	checkLeaks(t)
	n := startNode(t, "target", RoleWorker)
	c, err := net.Dial("udp", n.LocalAddr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	const datagrams = 500
	b := make([]byte, 200)
	for i := range datagrams {
		_, _ = rand.Read(b)
		b[0] = byte(i % 3) // 0, 1: "no installed keys could decrypt"; 2: unsupported version
		_, _ = c.Write(b)
		if i%50 == 49 {
			time.Sleep(5 * time.Millisecond) // let the receive buffer drain
		}
	}
	gossipLines := func() []observer.LoggedEntry {
		return n.logs.Filter(func(e observer.LoggedEntry) bool {
			return strings.HasPrefix(e.Message, "memberlist:") || strings.HasPrefix(e.Message, "refused gossip")
		}).All()
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(gossipLines()) == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // let memberlist finish the rest
	lines := gossipLines()
	if len(lines) == 0 || len(lines) > mlLogBurst {
		t.Fatalf("%d garbage datagrams: %d log lines, want 1 to %d", datagrams, len(lines), mlLogBurst)
	}
	for _, e := range lines {
		if e.Level > zapcore.WarnLevel {
			t.Errorf("garbage logged at %v: %s", e.Level, e.Message)
		}
	}
	t.Logf("%d lines for %d datagrams; first: %s %v", len(lines), datagrams, lines[0].Message, lines[0].ContextMap())
}

// TestMLLogLimit: the memberlist log bridge passes a burst of lines, drops the rest, and
// reports their number with the next line it passes.
func TestMLLogLimit(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	now := time.Unix(0, 0)
	w := &mlLogWriter{log: zap.New(core), lim: lograte.NewWithClock(mlLogBurst, mlLogEvery, func() time.Time { return now })}
	w.mu.lastKeyWarn = make(map[string]time.Time)
	for i := range 1000 {
		fmt.Fprintf(w, "[ERR] memberlist: Decrypt packet failed: unsupported encryption version %d from=10.0.0.%d:7946\n", i%200+2, i%250)
	}
	if logs.Len() != mlLogBurst {
		t.Fatalf("1000 lines: %d logged, want %d", logs.Len(), mlLogBurst)
	}
	if e := logs.All()[0]; e.Level != zapcore.WarnLevel || e.ContextMap()["remote_addr"] != "10.0.0.0:7946" {
		t.Errorf("first line: %v %v", e.Level, e.ContextMap())
	}
	now = now.Add(mlLogEvery)
	fmt.Fprintf(w, "[WARN] memberlist: Got ping for unexpected node x from=10.0.0.1:7946\n")
	last := logs.All()[logs.Len()-1]
	if got := last.ContextMap()["suppressed"]; got != int64(1000-mlLogBurst) {
		t.Errorf("line after the flood: suppressed=%v, want %d", got, 1000-mlLogBurst)
	}
}
