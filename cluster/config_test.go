package cluster

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
)

func TestConfigValidate(t *testing.T) {
	valid := DefaultConfig()
	valid.Key = testKey
	if err := valid.Validate(); err != nil {
		t.Fatalf("defaults with a key: %v", err)
	}
	if a, b := DefaultConfig().NodeName, DefaultConfig().NodeName; a == b {
		t.Errorf("default node names are not unique per process: %q", a)
	}
	for _, tc := range []struct {
		field string
		edit  func(*Config)
	}{
		{"node_name", func(c *Config) { c.NodeName = "" }},
		{"node_name", func(c *Config) { c.NodeName = "has space" }},
		{"bind", func(c *Config) { c.Bind = "localhost:7946" }},
		{"bind", func(c *Config) { c.Bind = "0.0.0.0" }},
		{"bind", func(c *Config) { c.Bind = "0.0.0.0:70000" }},
		{"advertise", func(c *Config) { c.Advertise = "node1:7946" }},
		{"gossip.probe_interval", func(c *Config) { c.Gossip.ProbeInterval = 0 }},
		{"gossip.probe_timeout", func(c *Config) { c.Gossip.ProbeTimeout = 2 * time.Second }},
		{"gossip.tcp_timeout", func(c *Config) { c.Gossip.TCPTimeout = -1 }},
		{"gossip.suspicion_mult", func(c *Config) { c.Gossip.SuspicionMult = 0 }},
		{"rendezvous_timeout", func(c *Config) { c.RendezvousTimeout = 0 }},
		{"key", func(c *Config) { c.Key = nil }},
		{"key", func(c *Config) { c.Key = make([]byte, 20) }},
	} {
		c := valid
		tc.edit(&c)
		err := c.Validate()
		if !errors.Is(err, ErrConfig) || !strings.HasPrefix(err.Error(), tc.field+":") {
			t.Errorf("%s: got %v, want an ErrConfig naming cluster.%s", tc.field, err, tc.field)
		}
	}
}

// TestMetaFits: the largest metadata the field limits allow, with long addresses, fits
// memberlist's 512-byte limit; beyond the limits it is an error, never memberlist's panic.
func TestMetaFits(t *testing.T) {
	longHost := strings.Repeat("h", maxAddrLen-len(":65535"))
	worst := Meta{
		Version: strings.Repeat("9", maxVersionLen),
		Role:    RoleCoordinator,
		Job:     strings.Repeat("j", maxJobLen),
		GRPC:    longHost + ":65535",
		Data:    longHost + ":65534",
		Devices: maxDevices,
		Memory:  ^uint64(0),
		Gen:     ^uint64(0),
		Rank:    MaxWorld - 1,
		Step:    1<<63 - 1,
		TLS:     strings.Repeat("f", fingerprintLen),
		Host:    strings.Repeat("0", maxHostLen),
	}
	b, err := worst.encode()
	if err != nil {
		t.Fatalf("largest valid meta: %v", err)
	}
	t.Logf("largest valid meta: %d bytes (limit %d)", len(b), memberlist.MetaMaxSize)
	back, err := decodeMeta(b)
	if err != nil || back != worst {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
	// A long IPv6 address with a zone fits too.
	v6 := worst
	v6.GRPC = "[fe80::ffff:ffff:ffff:ffff%enp1s0f0np0]:65535"
	if _, err := v6.encode(); err != nil {
		t.Errorf("IPv6 address: %v", err)
	}

	tooLong := worst
	tooLong.GRPC = strings.Repeat("h", maxAddrLen+1)
	if _, err := tooLong.encode(); !errors.Is(err, ErrMetaTooLarge) {
		t.Errorf("over-long address: got %v, want ErrMetaTooLarge", err)
	}
	if _, err := New(testConfig("x"), tooLong, nil); !errors.Is(err, ErrMetaTooLarge) {
		t.Errorf("New with over-long metadata: got %v, want ErrMetaTooLarge", err)
	}
	for _, bad := range []Meta{
		{Version: "0.1.0", Role: "boss"},
		{Version: "0.1.0", Role: RoleWorker, Job: "no spaces"},
		{Version: "0.1.0", Role: RoleWorker, GRPC: "a\"b"},
		{Version: "", Role: RoleWorker},
		{Version: "0.1.0", Role: RoleWorker, Devices: -1},
		{Version: "0.1.0", Role: RoleWorker, Host: strings.Repeat("0", maxHostLen+1)},
		{Version: "0.1.0", Role: RoleWorker, Host: "a\"b"},
	} {
		if _, err := bad.encode(); !errors.Is(err, ErrBadMeta) {
			t.Errorf("%+v: got %v, want ErrBadMeta", bad, err)
		}
	}

	// A peer's garbage is an error.
	for _, raw := range []string{"", "{", `{"v":"0.1.0","r":"worker","k":-7}`, `[1,2]`, `{"v":1}`} {
		if _, err := decodeMeta([]byte(raw)); err == nil {
			t.Errorf("decodeMeta(%q) accepted it", raw)
		}
	}
	if js, _ := json.Marshal(Meta{Version: "0.1.0", Role: RoleWorker, Rank: -1}); !strings.Contains(string(js), `"k":-1`) {
		t.Errorf("rank -1 must be explicit on the wire: %s", js)
	}
}

func TestUpdateMetaTooLarge(t *testing.T) {
	checkLeaks(t)
	n, err := New(testConfig("m"), Meta{Role: RoleWorker}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	before := n.LocalMeta()
	if err := n.UpdateMeta(func(m *Meta) { m.Data = strings.Repeat("x", 300) }); !errors.Is(err, ErrMetaTooLarge) {
		t.Errorf("got %v, want ErrMetaTooLarge", err)
	}
	if n.LocalMeta() != before {
		t.Error("a refused update changed the metadata")
	}
}
