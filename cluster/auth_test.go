package cluster

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

func dial(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

func wantCode(t *testing.T, what string, err error, code codes.Code) {
	t.Helper()
	if status.Code(err) != code {
		t.Errorf("%s: got %v, want %v", what, err, code)
	} else {
		t.Logf("%s: %v", what, err)
	}
}

// rosterFor signs a one-worker roster naming w.
func rosterFor(t *testing.T, key []byte, job string, gen uint64, w *testNode) *rosterMsg {
	t.Helper()
	m := w.LocalMeta()
	r := &Roster{Job: job, Gen: gen, Secret: make([]byte, secretLen), Members: []RosterMember{
		{Name: "coord", GRPC: "127.0.0.1:1"},
		{Name: w.LocalName(), GRPC: m.GRPC, Gen: m.Gen},
	}}
	msg, err := signRoster(deriveKeys(key), r)
	if err != nil {
		t.Fatal(err)
	}
	return msg
}

// TestControlAuth: calls without credentials, with another key's credentials, or carrying
// a forged roster are refused with codes.Unauthenticated; observers and strangers refuse
// rosters; commits need a prepared roster.
func TestControlAuth(t *testing.T) {
	checkLeaks(t)
	w := startNode(t, "w", RoleWorker)
	obs := startNode(t, "obs", RoleObserver)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	addr := w.LocalMeta().GRPC
	good := rosterFor(t, testKey, "job", 10, w)

	none := dial(t, addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	_, err := callPrepare(ctx, none, good)
	wantCode(t, "no credentials", err, codes.Unauthenticated)

	wrong := dial(t, addr, DialOptions(otherKey, nil)...)
	_, err = callPrepare(ctx, wrong, good)
	wantCode(t, "another key's credentials", err, codes.Unauthenticated)

	cc := dial(t, addr, DialOptions(testKey, nil)...)
	forged := rosterFor(t, testKey, "job", 10, w)
	forged.Config = []byte("steps: 1000000") // changed after signing
	_, err = callPrepare(ctx, cc, forged)
	wantCode(t, "tampered roster", err, codes.Unauthenticated)
	_, err = callPrepare(ctx, cc, rosterFor(t, otherKey, "job", 10, w))
	wantCode(t, "roster signed with another key", err, codes.Unauthenticated)
	_, err = callCommit(ctx, cc, &commitMsg{Job: "job", Gen: 10, MAC: make([]byte, 32)})
	wantCode(t, "forged commit", err, codes.Unauthenticated)

	_, err = callCommit(ctx, cc, signCommit(deriveKeys(testKey), "job", 10))
	wantCode(t, "commit before prepare", err, codes.FailedPrecondition)

	obsCC := dial(t, obs.LocalMeta().GRPC, DialOptions(testKey, nil)...)
	_, err = callPrepare(ctx, obsCC, rosterFor(t, testKey, "job", 10, obs))
	wantCode(t, "roster for an observer", err, codes.FailedPrecondition)

	stranger := rosterFor(t, testKey, "job", 10, w)
	stranger.Members[1].Name = "someone-else"
	stranger.MAC = mac(deriveKeys(testKey).rosterMAC, stranger.macInput())
	_, err = callPrepare(ctx, cc, stranger)
	wantCode(t, "roster not naming the node", err, codes.FailedPrecondition)

	restarted := rosterFor(t, testKey, "job", 10, w)
	restarted.Members[1].Gen++
	restarted.MAC = mac(deriveKeys(testKey).rosterMAC, restarted.macInput())
	_, err = callPrepare(ctx, cc, restarted)
	wantCode(t, "roster naming an earlier incarnation", err, codes.FailedPrecondition)

	// The genuine article goes through; then an older one is stale.
	ack, err := callPrepare(ctx, cc, good)
	if err != nil || ack.Name != "w" || ack.Rank != 1 {
		t.Fatalf("genuine prepare: %+v, %v", ack, err)
	}
	if _, err := callCommit(ctx, cc, signCommit(deriveKeys(testKey), "job", 10)); err != nil {
		t.Fatalf("commit: %v", err)
	}
	_, err = callPrepare(ctx, cc, rosterFor(t, testKey, "job", 9, w))
	wantCode(t, "stale roster", err, codes.FailedPrecondition)
	r, err := w.AwaitRoster(ctx)
	if err != nil || r.Gen != 10 || r.Rank != 1 {
		t.Fatalf("AwaitRoster after commit: %+v, %v", r, err)
	}
	_, err = callPrepare(ctx, cc, rosterFor(t, testKey, "other-job", 11, w))
	wantCode(t, "roster of another job", err, codes.FailedPrecondition)
}

// A stream service standing in for the collectives' frame service.
type echoServer interface{}

var echoDesc = grpc.ServiceDesc{
	ServiceName: "test.Echo",
	HandlerType: (*echoServer)(nil),
	Streams: []grpc.StreamDesc{{
		StreamName:    "Stream",
		ServerStreams: true,
		ClientStreams: true,
		Handler: func(_ any, ss grpc.ServerStream) error {
			var m map[string]string
			if err := ss.RecvMsg(&m); err != nil {
				return err
			}
			return ss.SendMsg(m)
		},
	}},
}

// TestStreamAuth: streams (the collectives' transport) are refused without the key.
func TestStreamAuth(t *testing.T) {
	checkLeaks(t)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(ServerOptions(testKey, nil, nil)...)
	srv.RegisterService(&echoDesc, struct{}{})
	served := make(chan struct{})
	go func() { defer close(served); _ = srv.Serve(lis) }()
	defer func() { srv.Stop(); <-served }()

	echo := func(opts ...grpc.DialOption) error {
		cc, err := grpc.NewClient(lis.Addr().String(), opts...)
		if err != nil {
			return err
		}
		defer cc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		s, err := cc.NewStream(ctx, &echoDesc.Streams[0], "/test.Echo/Stream", grpc.CallContentSubtype(codecName))
		if err != nil {
			return err
		}
		if err := s.SendMsg(map[string]string{"hi": "there"}); err != nil && !errors.Is(err, io.EOF) {
			return err
		}
		var out map[string]string
		if err := s.RecvMsg(&out); err != nil {
			return err
		}
		if out["hi"] != "there" {
			return errors.New("bad echo")
		}
		return nil
	}
	wantCode(t, "stream without credentials", echo(grpc.WithTransportCredentials(insecure.NewCredentials())), codes.Unauthenticated)
	wantCode(t, "stream with another key", echo(DialOptions(otherKey, nil)...), codes.Unauthenticated)
	if err := echo(DialOptions(testKey, nil)...); err != nil {
		t.Fatalf("stream with the key: %v", err)
	}
}

// TestAuthenticator: replays, stale or future timestamps, tokens moved to another method
// and malformed headers are refused.
func TestAuthenticator(t *testing.T) {
	key := deriveKeys(testKey).grpc
	now := time.Unix(1_700_000_000, 0)
	a := newAuthenticator(key, func() time.Time { return now })
	call := func(tok string, method string) error {
		ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(authHeader, tok))
		return a.verify(ctx, method)
	}
	tok, err := authToken(key, methodPrepare, now)
	if err != nil {
		t.Fatal(err)
	}
	if err := call(tok, methodPrepare); err != nil {
		t.Fatalf("fresh token: %v", err)
	}
	wantCode(t, "replay", call(tok, methodPrepare), codes.Unauthenticated)
	tok2, _ := authToken(key, methodPrepare, now)
	wantCode(t, "token for another method", call(tok2, methodCommit), codes.Unauthenticated)
	old, _ := authToken(key, methodPrepare, now.Add(-AuthWindow-time.Second))
	wantCode(t, "stale token", call(old, methodPrepare), codes.Unauthenticated)
	future, _ := authToken(key, methodPrepare, now.Add(AuthWindow+time.Second))
	wantCode(t, "future token", call(future, methodPrepare), codes.Unauthenticated)
	skewed, _ := authToken(key, methodPrepare, now.Add(-AuthWindow/2))
	if err := call(skewed, methodPrepare); err != nil {
		t.Errorf("token within the window: %v", err)
	}
	for _, bad := range []string{"", "v1", "v1.x.y.z", "v2.1.00.00", strings.Repeat("a", 200)} {
		wantCode(t, "malformed "+bad, call(bad, methodPrepare), codes.Unauthenticated)
	}
	wantCode(t, "no header", a.verify(context.Background(), methodPrepare), codes.Unauthenticated)

	// Nonces are forgotten once their timestamps leave the window, and the cache shrinks.
	now = now.Add(3 * AuthWindow)
	fresh, _ := authToken(key, methodPrepare, now)
	if err := call(fresh, methodPrepare); err != nil {
		t.Fatal(err)
	}
	a.mu.Lock()
	size := len(a.mu.seen)
	a.mu.Unlock()
	if size != 1 {
		t.Errorf("replay cache holds %d nonces, want 1", size)
	}
}

func TestRosterSealing(t *testing.T) {
	k := deriveKeys(testKey)
	r := &Roster{Job: "j", Gen: 3, Secret: []byte("0123456789abcdef0123456789abcdef"), Config: []byte("a: 1"),
		Members: []RosterMember{{Name: "c", GRPC: "g", Data: "d", Gen: 1}}}
	m, err := signRoster(k, r)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(m.SealedSecret), "0123456789") {
		t.Error("secret travels in the clear")
	}
	back, err := openRoster(k, m)
	if err != nil || string(back.Secret) != string(r.Secret) || back.World != 1 {
		t.Fatalf("open: %+v, %v", back, err)
	}
	// The sealed secret is bound to the job and generation.
	m2 := *m
	m2.Gen = 4
	m2.MAC = mac(k.rosterMAC, m2.macInput())
	if _, err := openRoster(k, &m2); !errors.Is(err, ErrBadRoster) || errors.Is(err, errSignature) {
		t.Errorf("secret moved to another generation: %v", err)
	}
	dup := *m
	dup.Members = []RosterMember{{Name: "x"}, {Name: "x"}}
	dup.MAC = mac(k.rosterMAC, dup.macInput())
	if _, err := openRoster(k, &dup); !errors.Is(err, ErrBadRoster) {
		t.Errorf("duplicate names: %v", err)
	}
	if _, err := openRoster(k, nil); !errors.Is(err, errSignature) {
		t.Errorf("nil roster: %v", err)
	}
}
