package cluster

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
)

// Roster is the agreed membership of a job: who has which rank and how to reach them, the
// job's configuration and the per-job data-plane secret. Every rank holds an identical
// roster (except Rank) before the first collective.
type Roster struct {
	Job     string
	Gen     uint64 // rendezvous generation: a newer rendezvous of the same job has a larger Gen
	World   int
	Members []RosterMember // index = rank; rank 0 is the coordinator
	Config  []byte         // the job's configuration (YAML), from the coordinator
	Secret  []byte         // per-job data-plane secret (collective.NewHello / VerifyHello)
	Rank    int            // this node's rank
}

// RosterMember is one rank's entry.
type RosterMember struct {
	Name string // node name
	GRPC string // gRPC address
	Data string // raw-TCP data-plane address, "" if none
	Gen  uint64 // the node's Meta.Gen: a restarted process under the same name refuses the roster
	// Host is the node's Meta.Host: ranks with the same Host can share memory (see HostID),
	// which collective.transport auto uses to pick shared memory within a host.
	Host string `json:"host,omitempty"`
}

// Clone returns a deep copy.
func (r *Roster) Clone() *Roster {
	c := *r
	c.Members = slices.Clone(r.Members)
	c.Config = bytes.Clone(r.Config)
	c.Secret = bytes.Clone(r.Secret)
	return &c
}

// RankOf returns the rank of the named node, or -1.
func (r *Roster) RankOf(name string) int {
	for i, m := range r.Members {
		if m.Name == name {
			return i
		}
	}
	return -1
}

const secretLen = 32

// ErrBadRoster: a roster that is forged, corrupt, stale or not meant for this node.
var ErrBadRoster = errors.New("cluster: roster refused")

// errSignature marks a roster or commit whose HMAC does not verify.
var errSignature = errors.New("bad signature (forged, corrupted, or signed with another cluster key)")

// rosterMsg is a roster on the wire. The data secret is sealed (AES-256-GCM under a key
// derived from the cluster key), because without TLS the gRPC traffic is readable; the
// whole message is signed (HMAC-SHA256 under another derived key), so a member accepts only
// rosters made by a holder of the cluster key.
type rosterMsg struct {
	Job          string         `json:"job"`
	Gen          uint64         `json:"gen"`
	Members      []RosterMember `json:"members"`
	Config       []byte         `json:"config"`
	SealedSecret []byte         `json:"sealed_secret"`
	MAC          []byte         `json:"mac"`
}

// commitMsg tells the members that every rank has accepted roster (Job, Gen).
type commitMsg struct {
	Job string `json:"job"`
	Gen uint64 `json:"gen"`
	MAC []byte `json:"mac"`
}

// ackMsg answers Prepare and Commit: who answered, with which rank.
type ackMsg struct {
	Name string `json:"name"`
	Rank int    `json:"rank"`
	// Suspects: members of the roster's previous generation that this member's own
	// collectives found gone (Node.Suspect); a re-forming coordinator leaves them out.
	Suspects []string `json:"suspects,omitempty"`
}

// The MAC input is a length-prefixed binary encoding, not the JSON, so that it does not
// depend on how a JSON encoder orders or escapes things.
func appendLP(b []byte, s []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

func (m *rosterMsg) macInput() []byte {
	b := []byte("qvd-roster-v2")
	b = binary.BigEndian.AppendUint64(b, m.Gen)
	b = appendLP(b, []byte(m.Job))
	b = binary.BigEndian.AppendUint32(b, uint32(len(m.Members)))
	for _, mm := range m.Members {
		b = appendLP(b, []byte(mm.Name))
		b = appendLP(b, []byte(mm.GRPC))
		b = appendLP(b, []byte(mm.Data))
		b = binary.BigEndian.AppendUint64(b, mm.Gen)
		b = appendLP(b, []byte(mm.Host))
	}
	b = appendLP(b, m.Config)
	return appendLP(b, m.SealedSecret)
}

func (c *commitMsg) macInput() []byte {
	b := []byte("qvd-commit-v1")
	b = binary.BigEndian.AppendUint64(b, c.Gen)
	return appendLP(b, []byte(c.Job))
}

func mac(key, msg []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(msg)
	return m.Sum(nil)
}

func sealAAD(job string, gen uint64) []byte {
	b := binary.BigEndian.AppendUint64([]byte("qvd-secret-v1"), gen)
	return appendLP(b, []byte(job))
}

// signRoster turns r into a signed message with its secret sealed.
func signRoster(k derivedKeys, r *Roster) (*rosterMsg, error) {
	block, err := aes.NewCipher(k.rosterSeal)
	if err != nil {
		return nil, fmt.Errorf("cluster: roster seal key: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("cluster: roster seal: %w", err)
	}
	nonce := make([]byte, aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, fmt.Errorf("cluster: roster seal nonce: %w", err)
	}
	m := &rosterMsg{
		Job:          r.Job,
		Gen:          r.Gen,
		Members:      slices.Clone(r.Members),
		Config:       r.Config,
		SealedSecret: aead.Seal(nonce, nonce, r.Secret, sealAAD(r.Job, r.Gen)),
	}
	m.MAC = mac(k.rosterMAC, m.macInput())
	return m, nil
}

// openRoster verifies a roster message and returns the roster (Rank unset). A bad
// signature is reported as such, before anything else in the message is believed.
func openRoster(k derivedKeys, m *rosterMsg) (*Roster, error) {
	if m == nil || !hmac.Equal(m.MAC, mac(k.rosterMAC, m.macInput())) {
		return nil, fmt.Errorf("%w: %w", ErrBadRoster, errSignature)
	}
	if err := ValidJob(m.Job); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadRoster, err)
	}
	if len(m.Members) == 0 || len(m.Members) > MaxWorld {
		return nil, fmt.Errorf("%w: world size %d not in [1, %d]", ErrBadRoster, len(m.Members), MaxWorld)
	}
	seen := make(map[string]bool, len(m.Members))
	for i, mm := range m.Members {
		if mm.Name == "" || seen[mm.Name] {
			return nil, fmt.Errorf("%w: rank %d has an empty or duplicate name %q", ErrBadRoster, i, mm.Name)
		}
		seen[mm.Name] = true
		if len(mm.Host) > maxHostLen {
			return nil, fmt.Errorf("%w: rank %d has a host id of %d bytes (at most %d)", ErrBadRoster, i, len(mm.Host), maxHostLen)
		}
	}
	block, err := aes.NewCipher(k.rosterSeal)
	if err != nil {
		return nil, fmt.Errorf("cluster: roster seal key: %w", err)
	}
	aead, err := cipher.NewGCM(block)
	if err != nil {
		return nil, fmt.Errorf("cluster: roster seal: %w", err)
	}
	if len(m.SealedSecret) < aead.NonceSize() {
		return nil, fmt.Errorf("%w: sealed secret too short", ErrBadRoster)
	}
	ns := aead.NonceSize()
	secret, err := aead.Open(nil, m.SealedSecret[:ns], m.SealedSecret[ns:], sealAAD(m.Job, m.Gen))
	if err != nil {
		return nil, fmt.Errorf("%w: cannot unseal the data secret: %w", ErrBadRoster, err)
	}
	return &Roster{
		Job:     m.Job,
		Gen:     m.Gen,
		World:   len(m.Members),
		Members: slices.Clone(m.Members),
		Config:  bytes.Clone(m.Config),
		Secret:  secret,
		Rank:    -1,
	}, nil
}

func signCommit(k derivedKeys, job string, gen uint64) *commitMsg {
	c := &commitMsg{Job: job, Gen: gen}
	c.MAC = mac(k.rosterMAC, c.macInput())
	return c
}

func verifyCommit(k derivedKeys, c *commitMsg) error {
	if c == nil || !hmac.Equal(c.MAC, mac(k.rosterMAC, c.macInput())) {
		return fmt.Errorf("%w: commit: %w", ErrBadRoster, errSignature)
	}
	return nil
}
