package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/hashicorp/memberlist"
)

// Roles a node can have.
const (
	// RoleCoordinator: the node that ran `qvd train`; it takes rank 0 and hands out the roster.
	RoleCoordinator = "coordinator"
	// RoleWorker: a node started by `qvd join`; it receives the roster and a rank.
	RoleWorker = "worker"
	// RoleObserver: `qvd status` and similar tools; it is listed but never given a rank.
	RoleObserver = "observer"
)

// Meta is what a node tells the cluster about itself. It travels in memberlist's node
// metadata, which is limited to memberlist.MetaMaxSize (512) bytes in its JSON encoding; the
// per-field limits below keep the largest valid Meta within that limit (see TestMetaFits).
type Meta struct {
	Version string `json:"v"`           // internal/version.Version; at most 32 bytes
	Role    string `json:"r"`           // RoleCoordinator, RoleWorker or RoleObserver
	Job     string `json:"j,omitempty"` // job id ("" until a worker gets a roster); see ValidJob
	GRPC    string `json:"g,omitempty"` // gRPC address (control plane, gRPC data path); at most 112 bytes
	Data    string `json:"d,omitempty"` // raw-TCP data-plane address, "" if none; at most 112 bytes
	Devices int    `json:"n,omitempty"` // GPUs (0 on CPU)
	Memory  uint64 `json:"m,omitempty"` // bytes of memory available for training
	Gen     uint64 `json:"e"`           // generation: tells a restarted process from its predecessor
	Rank    int    `json:"k"`           // -1 until assigned
	Step    int64  `json:"s,omitempty"` // training step (updated at most every Config.StepInterval)
	// ModelBytes is what the member holds for training (parameters, gradients, master
	// weights, optimizer state, staging buffers), as its engine accounts it.
	ModelBytes uint64 `json:"b,omitempty"`
	// RSS is the member's resident set size and Peak its largest Go heap sampled at the end of
	// a training phase (forward+backward, communication, optimizer), in bytes, as of its
	// last step: the dashboard's per-rank memory. Gossiped like Step (SetMemory).
	RSS  uint64 `json:"x,omitempty"`
	Peak uint64 `json:"p,omitempty"`
	// TLS is the fingerprint of the node's TLS CA (TLS.Fingerprint), "" without TLS; set by
	// New from Config.TLS. Members must agree on it (see admit).
	TLS string `json:"t,omitempty"`
	// Host is the node's shared-memory domain (HostID): members with the same Host can use a
	// shared-memory transport between them. "" when unknown (never shared). At most 16 bytes.
	Host string `json:"h,omitempty"`
}

// Limits on Meta fields; with JSON's short keys the largest valid Meta is under 512 bytes.
const (
	maxVersionLen = 32
	maxJobLen     = 64
	maxAddrLen    = 112 // 128 until Host was added: the largest Meta must fit 512 bytes
	maxHostLen    = HostIDLen
	maxDevices    = 1 << 16
	// MaxWorld is the largest world size: the data plane's hello carries ranks as uint16.
	MaxWorld = 1<<16 - 1
)

// ErrMetaTooLarge: the metadata would not fit memberlist's limit.
var ErrMetaTooLarge = errors.New("cluster: node metadata too large")

// ErrBadMeta: metadata that is invalid (ours) or unreadable (a peer's).
var ErrBadMeta = errors.New("cluster: invalid node metadata")

// Validate checks the fields' values and lengths.
func (m Meta) Validate() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrBadMeta, fmt.Sprintf(format, args...))
	}
	if m.Version == "" || len(m.Version) > maxVersionLen {
		return bad("version %q must be 1 to %d bytes", m.Version, maxVersionLen)
	}
	switch m.Role {
	case RoleCoordinator, RoleWorker, RoleObserver:
	default:
		return bad("role %q must be %s, %s or %s", m.Role, RoleCoordinator, RoleWorker, RoleObserver)
	}
	if m.Job != "" {
		if err := ValidJob(m.Job); err != nil {
			return fmt.Errorf("%w: %w", ErrBadMeta, err)
		}
	}
	if !plainText(m.Version) {
		return bad("version %q must be printable ASCII", m.Version)
	}
	for _, a := range []struct{ name, v string }{{"grpc", m.GRPC}, {"data", m.Data}} {
		if len(a.v) > maxAddrLen {
			return fmt.Errorf("%w: %s address of %d bytes, at most %d", ErrMetaTooLarge, a.name, len(a.v), maxAddrLen)
		}
		if !plainText(a.v) {
			return bad("%s address %q must be printable ASCII", a.name, a.v)
		}
	}
	if len(m.TLS) > fingerprintLen || !plainText(m.TLS) {
		return bad("TLS fingerprint %q must be at most %d printable characters", m.TLS, fingerprintLen)
	}
	if len(m.Host) > maxHostLen || !plainText(m.Host) {
		return bad("host id %q must be at most %d printable characters", m.Host, maxHostLen)
	}
	if m.Devices < 0 || m.Devices > maxDevices {
		return bad("devices %d not in [0, %d]", m.Devices, maxDevices)
	}
	if m.Rank < -1 || m.Rank >= MaxWorld {
		return bad("rank %d not in [-1, %d)", m.Rank, MaxWorld)
	}
	if m.Step < 0 {
		return bad("step %d < 0", m.Step)
	}
	return nil
}

// plainText: printable ASCII that JSON does not escape, so a field's encoded length is its
// length and the size bound on Meta holds.
func plainText(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c > 0x7e || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}

// ValidJob checks a job id: 1 to 64 characters from [A-Za-z0-9._-], so it is safe in
// metadata, file names and log lines.
func ValidJob(job string) error {
	if job == "" || len(job) > maxJobLen {
		return fmt.Errorf("job id %q must be 1 to %d characters", job, maxJobLen)
	}
	for _, r := range job {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return fmt.Errorf("job id %q may only contain letters, digits, '.', '_' and '-'", job)
		}
	}
	return nil
}

// encode validates m and returns its wire form, which fits memberlist's limit.
func (m Meta) encode() ([]byte, error) {
	if err := m.Validate(); err != nil {
		return nil, err
	}
	b, err := json.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode node metadata: %w", err)
	}
	if len(b) > memberlist.MetaMaxSize {
		return nil, fmt.Errorf("%w: %d bytes, limit %d", ErrMetaTooLarge, len(b), memberlist.MetaMaxSize)
	}
	return b, nil
}

// decodeMeta reads a peer's metadata. A peer's bad metadata is an error, never a panic.
func decodeMeta(b []byte) (Meta, error) {
	if len(b) == 0 {
		return Meta{}, fmt.Errorf("%w: empty (not a qvd node?)", ErrBadMeta)
	}
	var m Meta
	if err := json.Unmarshal(b, &m); err != nil {
		return Meta{}, fmt.Errorf("%w: %w", ErrBadMeta, err)
	}
	if err := m.Validate(); err != nil {
		return Meta{}, err
	}
	return m, nil
}

// Compatible reports whether qvd versions a and b can work in one cluster: their
// major.minor must match (patch releases and pre-release suffixes interoperate). A version
// without a parseable major.minor (a developer build) is compatible only with itself.
func Compatible(a, b string) bool {
	ma, oka := majorMinor(a)
	mb, okb := majorMinor(b)
	if !oka || !okb {
		return a == b
	}
	return ma == mb
}

func majorMinor(v string) (string, bool) {
	v = strings.TrimPrefix(v, "v")
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return "", false
	}
	major, minor := parts[0], parts[1]
	// "1.2-rc1" and "1.2+meta": the minor is the leading digits.
	if i := strings.IndexAny(minor, "-+"); i >= 0 {
		minor = minor[:i]
	}
	if _, err := strconv.ParseUint(major, 10, 32); err != nil {
		return "", false
	}
	if _, err := strconv.ParseUint(minor, 10, 32); err != nil {
		return "", false
	}
	return major + "." + minor, true
}

// SetMemory records the member's resident set size and its largest phase-end heap, in bytes,
// for the dashboard; gossiped like the step (at most once per Config.StepInterval), never
// blocking.
func (n *Node) SetMemory(rss, peak uint64) {
	n.setProgress(func(m *Meta) bool {
		changed := m.RSS != rss || m.Peak != peak
		m.RSS, m.Peak = rss, peak
		return changed
	})
}
