package cluster

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/tap"

	"github.com/qvd/qvd/internal/lograte"
)

// gRPC authentication by the cluster key.
//
// Every call (unary, and every stream when it opens) carries the header
//
//	qvd-auth: v1.<unix nanoseconds>.<nonce, 32 hex>.<HMAC-SHA256, 64 hex>
//
// where the HMAC, under a key derived from the cluster key, covers the timestamp, the nonce
// and the full method name. The server accepts it only if the HMAC is right, the timestamp
// is within AuthWindow of its clock, and the nonce has not been seen within the window
// (so a captured header cannot be replayed, nor moved to another method).
//
// What this protects, and what not: without TLS, it authenticates callers — nobody without
// the cluster key can call the control service or open the collectives' streams — but it
// does not encrypt or integrity-protect the traffic after the header: an on-path attacker
// can read tensors and configs, and could tamper with an authenticated stream. The roster's
// own HMAC and its sealed data secret (see roster.go) do not depend on this. With mutual
// TLS (tls.go; ServerOptions and DialOptions given a *TLS) the header travels inside the
// encrypted channel and both checks apply: a caller needs a certificate from the cluster's
// CA and the key.

const (
	authHeader  = "qvd-auth"
	authVersion = "v1"
	nonceLen    = 16
	// AuthWindow bounds clock skew between nodes plus delivery time; credentials outside it
	// are refused, and nonces are remembered for this long to refuse replays.
	AuthWindow = 5 * time.Minute
	// maxRememberedNonces bounds the replay cache. Only calls with a valid HMAC reach it,
	// so filling it takes the key; qvd makes a few calls per job, not thousands per second.
	maxRememberedNonces = 1 << 20
)

// derivedKeys separates the uses of the cluster key, so that a MAC made for one purpose is
// never valid for another (the cluster key itself only encrypts gossip).
type derivedKeys struct {
	grpc       []byte // gRPC call authentication
	rosterMAC  []byte // roster signatures
	rosterSeal []byte // AES-256-GCM key sealing the roster's data secret
}

func deriveKeys(key []byte) derivedKeys {
	return derivedKeys{
		grpc:       kdf(key, "grpc-auth-v1"),
		rosterMAC:  kdf(key, "roster-mac-v1"),
		rosterSeal: kdf(key, "roster-seal-v1"),
	}
}

// kdf is HKDF-Expand with a single block (RFC 5869 §2.3, L = 32): the cluster key is already
// uniformly random, so the extract step adds nothing.
func kdf(key []byte, label string) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("qvd/cluster/" + label))
	m.Write([]byte{1})
	return m.Sum(nil)
}

func authMAC(key []byte, method string, ts int64, nonce []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte("qvd-grpc-" + authVersion))
	m.Write([]byte{0})
	m.Write([]byte(method))
	m.Write([]byte{0})
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], uint64(ts))
	m.Write(b[:])
	m.Write(nonce)
	return m.Sum(nil)
}

func authToken(key []byte, method string, now time.Time) (string, error) {
	nonce := make([]byte, nonceLen)
	if _, err := rand.Read(nonce); err != nil {
		return "", fmt.Errorf("cluster: credentials nonce: %w", err)
	}
	ts := now.UnixNano()
	return authVersion + "." + strconv.FormatInt(ts, 10) + "." + hex.EncodeToString(nonce) + "." +
		hex.EncodeToString(authMAC(key, method, ts, nonce)), nil
}

// keyCredentials proves possession of the cluster key on every call.
type keyCredentials struct {
	key []byte // derived gRPC key
	now func() time.Time
}

var _ credentials.PerRPCCredentials = keyCredentials{}

func (c keyCredentials) GetRequestMetadata(ctx context.Context, _ ...string) (map[string]string, error) {
	ri, ok := credentials.RequestInfoFromContext(ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "cluster: no gRPC request info to sign")
	}
	tok, err := authToken(c.key, ri.Method, c.now())
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return map[string]string{authHeader: tok}, nil
}

// RequireTransportSecurity is false so the credentials work over plain TCP when the cluster
// runs without TLS; see the comment above on what that leaves unprotected.
func (keyCredentials) RequireTransportSecurity() bool { return false }

// DialOptions returns the options every qvd gRPC client uses: per-call credentials proving
// possession of the cluster key, over mutual TLS with t, or over plain TCP when t is nil.
func DialOptions(key []byte, t *TLS) []grpc.DialOption {
	creds := insecure.NewCredentials()
	if t != nil {
		creds = credentials.NewTLS(t.ClientConfig())
	}
	return []grpc.DialOption{
		grpc.WithTransportCredentials(creds),
		grpc.WithPerRPCCredentials(keyCredentials{key: deriveKeys(key).grpc, now: time.Now}),
	}
}

// ServerOptions returns the options every qvd gRPC server installs: mutual TLS with t (none
// when t is nil: plain TCP), and a check that refuses each unary call and each stream with
// codes.Unauthenticated unless it carries valid credentials for the cluster key (see
// DialOptions).
//
// The check runs as the server's tap handle (grpc.InTapHandle), when a call's headers
// arrive and before any of its body is read: a caller without the key cannot make the
// server buffer or decode a request body (unary handlers decode the body before they run
// interceptors). ServerOptions therefore takes the server's one tap handle. Chained
// interceptors then check that the tap admitted the call, so other interceptors may be
// added.
//
// Refused calls and refused TLS handshakes are logged on log at WARN, with the remote
// address, at most refusalBurst lines per refusalEvery (a count of the lines left out goes
// with the next one), since anyone who can reach the port can cause them. log may be nil.
func ServerOptions(key []byte, t *TLS, log *zap.Logger) []grpc.ServerOption {
	if log == nil {
		log = zap.NewNop()
	}
	lim := lograte.New(refusalBurst, refusalEvery)
	a := newAuthenticator(deriveKeys(key).grpc, time.Now)
	a.log, a.lim = log, lim
	opts := []grpc.ServerOption{
		grpc.InTapHandle(a.tap),
		grpc.ChainUnaryInterceptor(a.unary),
		grpc.ChainStreamInterceptor(a.stream),
	}
	if t != nil {
		opts = append(opts, grpc.Creds(loggedCreds{
			TransportCredentials: credentials.NewTLS(t.ServerConfig()),
			log:                  log, lim: lim,
		}))
	}
	return opts
}

// Refusal logging limits: a misconfigured node retries every few seconds and shows in the
// first lines; a flood from outside costs at most this many lines.
const (
	refusalBurst = 5
	refusalEvery = 10 * time.Second
)

type authenticator struct {
	key []byte
	now func() time.Time
	log *zap.Logger      // nil: refusals are not logged
	lim *lograte.Limiter // bounds log

	mu struct {
		sync.Mutex
		seen      map[[nonceLen]byte]int64 // nonce → its timestamp (ns)
		lastPrune time.Time
	}
}

func newAuthenticator(key []byte, now func() time.Time) *authenticator {
	a := &authenticator{key: key, now: now}
	a.mu.seen = make(map[[nonceLen]byte]int64)
	return a
}

// admittedKey marks a call's context once the tap handle has verified its credentials; the
// value is the method they were verified for.
type admittedKey struct{}

// tap verifies a call's credentials from its headers, before its body is read. It runs on
// the connection's reader goroutine, so it must be quick: one HMAC and a map lookup.
func (a *authenticator) tap(ctx context.Context, info *tap.Info) (context.Context, error) {
	if err := a.verifyMD(info.Header, info.FullMethodName); err != nil {
		a.refused(ctx, info.FullMethodName, err)
		return ctx, err
	}
	return context.WithValue(ctx, admittedKey{}, info.FullMethodName), nil
}

// admitted checks a call in the interceptors: admitted by the tap, or (on a server built
// without it) verified now.
func (a *authenticator) admitted(ctx context.Context, method string) error {
	if m, ok := ctx.Value(admittedKey{}).(string); ok && m == method {
		return nil
	}
	if err := a.verify(ctx, method); err != nil {
		a.refused(ctx, method, err)
		return err
	}
	return nil
}

func (a *authenticator) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := a.admitted(ctx, info.FullMethod); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

func (a *authenticator) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := a.admitted(ss.Context(), info.FullMethod); err != nil {
		return err
	}
	return handler(srv, ss)
}

// refused logs a refused call, within the rate limit.
func (a *authenticator) refused(ctx context.Context, method string, err error) {
	if a.log == nil {
		return
	}
	ok, suppressed := a.lim.Allow()
	if !ok {
		return
	}
	a.log.Warn("refused a gRPC call", zap.String("method", method), zap.String("remote_addr", remoteOf(ctx)),
		zap.String("reason", status.Convert(err).Message()), lograte.Field(suppressed))
}

func remoteOf(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return "unknown"
}

// loggedCreds logs the TLS handshakes the server refuses (a client without a certificate
// from the cluster's CA, or speaking plain TCP to a TLS port): gRPC itself only drops the
// connection. A connection closed before its first byte (io.EOF: a port scanner, a health
// check) is not logged.
type loggedCreds struct {
	credentials.TransportCredentials
	log *zap.Logger
	lim *lograte.Limiter
}

func (c loggedCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	out, info, err := c.TransportCredentials.ServerHandshake(conn)
	if err != nil && !errors.Is(err, io.EOF) {
		if ok, suppressed := c.lim.Allow(); ok {
			c.log.Warn("refused a TLS handshake", zap.String("remote_addr", conn.RemoteAddr().String()),
				zap.Error(err), lograte.Field(suppressed))
		}
	}
	return out, info, err
}

func (c loggedCreds) Clone() credentials.TransportCredentials {
	return loggedCreds{TransportCredentials: c.TransportCredentials.Clone(), log: c.log, lim: c.lim}
}

func unauthenticated(format string, args ...any) error {
	return status.Errorf(codes.Unauthenticated, "qvd: "+format, args...)
}

// verify checks the call's credentials; the order (HMAC, then time, then nonce) means only
// key holders can touch the replay cache.
func (a *authenticator) verify(ctx context.Context, method string) error {
	md, _ := metadata.FromIncomingContext(ctx)
	return a.verifyMD(md, method)
}

func (a *authenticator) verifyMD(md metadata.MD, method string) error {
	vals := md.Get(authHeader)
	if len(vals) == 0 {
		return unauthenticated("call to %s has no cluster credentials: the caller must hold the cluster key (dial with cluster.DialOptions)", method)
	}
	if len(vals) > 1 {
		return unauthenticated("call to %s has %d credential headers, want 1", method, len(vals))
	}
	parts := strings.Split(vals[0], ".")
	if len(parts) != 4 || parts[0] != authVersion {
		return unauthenticated("malformed cluster credentials on %s", method)
	}
	ts, err := strconv.ParseInt(parts[1], 10, 64)
	nonce, err2 := hex.DecodeString(parts[2])
	mac, err3 := hex.DecodeString(parts[3])
	if err != nil || err2 != nil || err3 != nil || len(nonce) != nonceLen || len(mac) != sha256.Size {
		return unauthenticated("malformed cluster credentials on %s", method)
	}
	if !hmac.Equal(mac, authMAC(a.key, method, ts, nonce)) {
		return unauthenticated("bad cluster credentials on %s: the caller uses another cluster key", method)
	}
	now := a.now()
	if d := now.Sub(time.Unix(0, ts)); d > AuthWindow || d < -AuthWindow {
		return unauthenticated("cluster credentials on %s are %v off this node's clock (limit %v): clock skew, or a replay", method, d.Round(time.Millisecond), AuthWindow)
	}

	var key [nonceLen]byte
	copy(key[:], nonce)
	a.mu.Lock()
	defer a.mu.Unlock()
	if now.Sub(a.mu.lastPrune) > AuthWindow/8 || len(a.mu.seen) >= maxRememberedNonces {
		cutoff := now.Add(-AuthWindow).UnixNano()
		for k, t := range a.mu.seen {
			if t < cutoff {
				delete(a.mu.seen, k)
			}
		}
		a.mu.lastPrune = now
	}
	if _, dup := a.mu.seen[key]; dup {
		return unauthenticated("replayed cluster credentials on %s", method)
	}
	if len(a.mu.seen) >= maxRememberedNonces {
		return status.Errorf(codes.ResourceExhausted, "qvd: too many authenticated calls within %v", AuthWindow)
	}
	a.mu.seen[key] = ts
	return nil
}
