package collective_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/qvd/qvd/collective"
)

func TestRosterValidate(t *testing.T) {
	ok := collective.Roster{Job: "j", Rank: 1, Addrs: []string{"a:1", ""}, Secret: []byte("s")}
	if err := ok.Validate(); err != nil {
		t.Fatalf("valid roster (own address empty): %v", err)
	}
	for _, tc := range []struct {
		name string
		mod  func(g *collective.Roster)
		want string
	}{
		{"job", func(g *collective.Roster) { g.Job = "" }, "job:"},
		{"no ranks", func(g *collective.Roster) { g.Addrs = nil }, "addrs:"},
		{"too many", func(g *collective.Roster) { g.Addrs = make([]string, 1<<16+1) }, "addrs:"},
		{"rank", func(g *collective.Roster) { g.Rank = 2 }, "rank:"},
		{"secret", func(g *collective.Roster) { g.Secret = nil }, "secret:"},
		{"peer address", func(g *collective.Roster) { g.Rank = 0; g.Addrs = []string{"", ""} }, "addrs[1]:"},
	} {
		g := ok
		tc.mod(&g)
		if err := g.Validate(); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("%s: %v, want an error starting %q", tc.name, err, tc.want)
		}
	}
}

func TestJobs(t *testing.T) {
	type tr struct{ name string }
	a, b := &tr{"a"}, &tr{"b"}
	var j collective.Jobs[*tr]
	_, _, _, changed := j.Get("x")
	if err := j.Register("x", a); err != nil {
		t.Fatal(err)
	}
	select {
	case <-changed:
	default:
		t.Error("a registration did not wake the waiters")
	}
	if err := j.Register("x", b); !errors.Is(err, collective.ErrJobRegistered) {
		t.Errorf("second transport for a job: %v", err)
	}
	if got, ok, closed, _ := j.Get("x"); !ok || closed || got != a {
		t.Errorf("Get: %v %v %v", got, ok, closed)
	}
	j.Unregister("x", b) // not x's transport: no effect
	if all, _, _ := j.All(); len(all) != 1 || all[0] != a {
		t.Errorf("All: %v", all)
	}
	if err := j.Register("y", b); err != nil {
		t.Fatal(err)
	}
	j.Unregister("y", b)
	if _, ok, _, _ := j.Get("y"); ok {
		t.Error("unregistered transport still found")
	}
	if got := j.Close(); len(got) != 1 || got[0] != a {
		t.Errorf("Close returned %v", got)
	}
	if got := j.Close(); got != nil {
		t.Errorf("second Close returned %v", got)
	}
	if err := j.Register("z", b); !errors.Is(err, collective.ErrClosed) {
		t.Errorf("register after Close: %v", err)
	}
}

func TestCheckTransport(t *testing.T) {
	for _, name := range collective.Transports() {
		if err := collective.CheckTransport(name); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		cfg := collective.DefaultConfig()
		cfg.Transport = name
		if err := cfg.Validate(); err != nil {
			t.Errorf("Config.Validate(%s): %v", name, err)
		}
	}
	for _, name := range []string{"", "udp", collective.TransportInproc} {
		err := collective.CheckTransport(name)
		if err == nil || !strings.Contains(err.Error(), "must be auto, shm, tcp, grpc or nccl") {
			t.Errorf("%q: %v", name, err)
		}
	}
	cfg := collective.DefaultConfig()
	cfg.Transport = collective.TransportInproc
	if err := cfg.Validate(); err != nil {
		t.Errorf("Config.Validate accepts inproc for tests: %v", err)
	}
}
