package cluster

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"
)

// Config configures a node's membership, gossip and rendezvous. It is part of the `cluster`
// section of qvd's YAML configuration; the cluster key is not, because a key must not live
// in a file that is copied around with the job: the caller reads it from --cluster-key-file
// or QVD_CLUSTER_KEY and sets Key.
type Config struct {
	// NodeName names this process in the cluster. It must be unique among live members;
	// the default, "<hostname>-<6 random hex digits>", is unique per process so that a
	// restarted process never collides with the memory of its predecessor.
	NodeName string `yaml:"node_name"`
	// Bind is the gossip address, host:port, where host is an IP literal. Port 0 picks a
	// free port (used by tests and by `qvd status`).
	Bind string `yaml:"bind"`
	// Advertise is the gossip address others should use, ip:port, when Bind is not
	// reachable from them (NAT, containers). Empty: derived from Bind, and when Bind is
	// the unspecified address, from this host's first private IP.
	Advertise string `yaml:"advertise"`
	// Gossip tunes failure detection (see GossipConfig).
	Gossip GossipConfig `yaml:"gossip"`
	// RendezvousTimeout bounds Coordinate and AwaitRoster.
	RendezvousTimeout time.Duration `yaml:"rendezvous_timeout"`
	// StepInterval is the least time between two gossip updates caused by SetStep: the
	// training step is for humans (`qvd status`), not worth a broadcast per step.
	StepInterval time.Duration `yaml:"step_interval"`
	// Key is the cluster key: 16, 24 or 32 random bytes (`qvd keygen`; ValidateKey refuses
	// keys that are evidently not random). It encrypts gossip (AES-GCM, via memberlist's
	// keyring), authenticates gRPC calls (ServerOptions, DialOptions) and signs rosters.
	// Required.
	Key []byte `yaml:"-"`
	// TLS, when not nil, is this node's mutual-TLS identity: the caller loads it (see
	// TLSConfig) and builds its gRPC server with ServerOptions(Key, TLS). The node dials the
	// rendezvous over it and advertises its CA's fingerprint, so a node with another CA, or
	// with TLS on one side only, is refused at join (ErrTLSMismatch).
	TLS *TLS `yaml:"-" json:"-"`
}

// GossipConfig tunes memberlist's SWIM failure detector. The defaults are for training
// clusters on a LAN, where a lost rank should stall the job for seconds, not minutes:
//
//	probe_interval 1s, probe_timeout 500ms, suspicion_mult 3, gossip_interval 200ms,
//	push_pull_interval 15s, tcp_timeout 5s.
//
// Detection time of a killed member, in a cluster of n ≤ 9 members: some member probes it
// within a probe interval or two (each member probes one peer per interval, in shuffled
// round-robin); direct and indirect probes fail within that interval; the member is then
// suspected for suspicion_mult × max(1, log10 n) × probe_interval = 3s — the minimum, once
// one other member confirms the suspicion (or n ≤ 3); unconfirmed it lasts up to 4× as
// long (12s). The Failed event follows 250ms later (leaveIntentGrace). Measured with these
// defaults on one machine, 5 members: 5.0–6.1s from kill to Failed on every survivor. It
// grows with log10 n beyond 10 members (about 6s of suspicion at 100). memberlist's
// local-health awareness stretches probes on an overloaded node (up to 8×), which delays
// but does not prevent detection.
type GossipConfig struct {
	// ProbeInterval: how often each member probes one random peer.
	ProbeInterval time.Duration `yaml:"probe_interval"`
	// ProbeTimeout: how long a direct probe waits for its ack (LAN round trip plus
	// scheduling slack) before indirect probes through other members are tried.
	ProbeTimeout time.Duration `yaml:"probe_timeout"`
	// GossipInterval: how often queued broadcasts (joins, deaths, metadata) are gossiped.
	GossipInterval time.Duration `yaml:"gossip_interval"`
	// PushPullInterval: how often a member does a full state exchange with a random peer,
	// which repairs anything lost by UDP gossip.
	PushPullInterval time.Duration `yaml:"push_pull_interval"`
	// TCPTimeout bounds every TCP exchange of the gossip layer (joins, push/pull, reliable
	// messages) and the graceful leave on Close.
	TCPTimeout time.Duration `yaml:"tcp_timeout"`
	// SuspicionMult: a suspected member is declared dead after
	// suspicion_mult × max(1, log10 n) × probe_interval unless it refutes.
	SuspicionMult int `yaml:"suspicion_mult"`
}

// suspicionMaxTimeoutMult bounds how much longer than the minimum a suspicion may last
// when no other member confirms it (memberlist's Lifeguard extension); memberlist's LAN
// default is 6, we take 4 so an unconfirmed death still surfaces within ~12s.
const suspicionMaxTimeoutMult = 4

// Field limits that keep a node's metadata within memberlist's 512-byte limit (see Meta).
const (
	maxNodeName = 128
	defaultPort = 7946
)

// DefaultConfig returns the defaults described on Config and GossipConfig. Key is left
// empty: the caller must set it.
func DefaultConfig() Config {
	return Config{
		NodeName: defaultNodeName(),
		Bind:     net.JoinHostPort("0.0.0.0", strconv.Itoa(defaultPort)),
		Gossip: GossipConfig{
			ProbeInterval:    time.Second,
			ProbeTimeout:     500 * time.Millisecond,
			GossipInterval:   200 * time.Millisecond,
			PushPullInterval: 15 * time.Second,
			TCPTimeout:       5 * time.Second,
			SuspicionMult:    3,
		},
		RendezvousTimeout: 2 * time.Minute,
		StepInterval:      5 * time.Second,
	}
}

func defaultNodeName() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "qvd"
	}
	var b [3]byte
	_, _ = rand.Read(b[:])
	return host + "-" + hex.EncodeToString(b[:])
}

// ErrConfig marks an invalid Config.
var ErrConfig = errors.New("cluster: invalid config")

// configError reads "field: problem" (the composing config adds the section name) and
// matches ErrConfig.
type configError string

func (e configError) Error() string        { return string(e) }
func (e configError) Is(target error) bool { return target == ErrConfig }

// Validate checks every field and names the offending one by its YAML name. Of the key it
// checks the length only: a configuration is validated before the key is read (configs
// does so with a placeholder key); New refuses a weak key (ValidateKey).
func (c Config) Validate() error {
	bad := func(field, format string, args ...any) error {
		return configError(field + ": " + fmt.Sprintf(format, args...))
	}
	if c.NodeName == "" || len(c.NodeName) > maxNodeName {
		return bad("node_name", "must be 1 to %d bytes, got %d", maxNodeName, len(c.NodeName))
	}
	for _, r := range c.NodeName {
		if r <= ' ' || r == 0x7f {
			return bad("node_name", "%q contains a space or control character", c.NodeName)
		}
	}
	if _, _, err := splitIPPort(c.Bind); err != nil {
		return bad("bind", "%v", err)
	}
	if c.Advertise != "" {
		if _, _, err := splitIPPort(c.Advertise); err != nil {
			return bad("advertise", "%v", err)
		}
	}
	g := c.Gossip
	for _, f := range []struct {
		name string
		d    time.Duration
	}{
		{"gossip.probe_interval", g.ProbeInterval},
		{"gossip.probe_timeout", g.ProbeTimeout},
		{"gossip.gossip_interval", g.GossipInterval},
		{"gossip.push_pull_interval", g.PushPullInterval},
		{"gossip.tcp_timeout", g.TCPTimeout},
		{"rendezvous_timeout", c.RendezvousTimeout},
		{"step_interval", c.StepInterval},
	} {
		if f.d <= 0 {
			return bad(f.name, "must be positive, got %v", f.d)
		}
	}
	if g.ProbeTimeout >= g.ProbeInterval {
		return bad("gossip.probe_timeout", "%v must be shorter than gossip.probe_interval %v", g.ProbeTimeout, g.ProbeInterval)
	}
	if g.SuspicionMult < 1 || g.SuspicionMult > 100 {
		return bad("gossip.suspicion_mult", "must be in [1, 100], got %d", g.SuspicionMult)
	}
	if err := checkKeyLength(c.Key); err != nil {
		return fieldError{field: "key", err: err}
	}
	return nil
}

// fieldError is a configError that keeps its cause (ErrWeakKey) for errors.Is.
type fieldError struct {
	field string
	err   error
}

func (e fieldError) Error() string        { return e.field + ": " + e.err.Error() }
func (e fieldError) Is(target error) bool { return target == ErrConfig }
func (e fieldError) Unwrap() error        { return e.err }

// splitIPPort parses ip:port. memberlist binds and advertises IP literals only, so a host
// name is refused here rather than failing obscurely later.
func splitIPPort(addr string) (net.IP, int, error) {
	host, portStr, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, 0, fmt.Errorf("%q is not host:port: %w", addr, err)
	}
	ip := net.ParseIP(host)
	if ip == nil {
		return nil, 0, fmt.Errorf("%q: host must be an IP address (e.g. 0.0.0.0 or 10.0.0.5)", addr)
	}
	port, err := strconv.Atoi(portStr)
	if err != nil || port < 0 || port > 65535 {
		return nil, 0, fmt.Errorf("%q: port must be in [0, 65535]", addr)
	}
	return ip, port, nil
}
