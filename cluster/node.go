package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"

	"github.com/qvd/qvd/internal/version"
)

// Sentinel errors callers test with errors.Is.
var (
	// ErrClosed: the node was closed.
	ErrClosed = errors.New("cluster: node closed")
	// ErrKeyMismatch: a peer and this node do not share the cluster key.
	ErrKeyMismatch = errors.New("cluster: cluster key mismatch")
	// ErrIncompatibleVersion: a peer runs a qvd whose major.minor differs from ours.
	ErrIncompatibleVersion = errors.New("cluster: incompatible qvd version")
	// ErrTLSMismatch: a peer uses mutual TLS with another CA than ours, or only one of us
	// uses TLS at all.
	ErrTLSMismatch = errors.New("cluster: TLS setup mismatch")
	// ErrNameTaken: a live member of the cluster already has this node's name (node names
	// must be unique: ranks and rosters go by them).
	ErrNameTaken = errors.New("cluster: node name already taken")
	// ErrNotQVD: the peer answered, but not as a qvd node does (another service listens on
	// that port).
	ErrNotQVD = errors.New("cluster: peer is not a qvd node")
	// ErrJoin: no peer could be joined, for a reason other than those above.
	ErrJoin = errors.New("cluster: join failed")
)

// Retryable reports whether a failed Join may succeed if tried again: no peer was reachable
// or none answered (it may be starting). A refusal — ErrKeyMismatch, ErrIncompatibleVersion,
// ErrTLSMismatch, ErrNameTaken, ErrNotQVD — is final, and so is a cancelled context.
func Retryable(err error) bool {
	for _, final := range []error{ErrKeyMismatch, ErrIncompatibleVersion, ErrTLSMismatch, ErrNameTaken, ErrNotQVD, ErrClosed, context.Canceled} {
		if errors.Is(err, final) {
			return false
		}
	}
	return err != nil
}

// Member is one node as this node sees it.
type Member struct {
	Name  string // node name
	Addr  string // gossip address, ip:port
	State string // StateAlive, StateSuspect, StateDead or StateLeft
	Meta  Meta
}

// Member states. memberlist does not expose suspicion through its public API, so live
// members are reported as alive; dead and left appear on events.
const (
	StateAlive   = "alive"
	StateSuspect = "suspect"
	StateDead    = "dead"
	StateLeft    = "left"
)

// EventKind says what happened to a member.
type EventKind int

// Event kinds.
const (
	// Joined: a member appeared.
	Joined EventKind = iota + 1
	// Updated: a member's metadata changed (rank, job, step).
	Updated
	// Left: a member left gracefully (it closed its node).
	Left
	// Failed: the failure detector declared a member dead (killed, crashed, partitioned).
	Failed
)

func (k EventKind) String() string {
	switch k {
	case Joined:
		return "joined"
	case Updated:
		return "updated"
	case Left:
		return "left"
	case Failed:
		return "failed"
	}
	return "EventKind(" + strconv.Itoa(int(k)) + ")"
}

// Event reports a change of another member (never this node itself).
type Event struct {
	Kind   EventKind
	Member Member
}

// Event delivery: memberlist calls its delegates with its own locks held, so events are
// queued without blocking and a pump goroutine delivers them on the Events channel.
const (
	eventChanCap = 64
	// maxQueuedEvents bounds memory when nobody reads Events; beyond it, Updated events
	// (the only unbounded kind: step updates) are dropped. Joins and departures are kept.
	maxQueuedEvents = 4096
	// leaveIntentGrace: a departing member first tells every peer it is leaving (over TCP)
	// and then gossips its departure (over UDP); a peer that sees the departure before the
	// notice waits this long for it before reporting Failed instead of Left.
	leaveIntentGrace = 250 * time.Millisecond
	// leaveIntentTTL: forget a leave notice not followed by a departure.
	leaveIntentTTL = time.Minute
	// deadNodeReclaimTime: see memberlistConfig.
	deadNodeReclaimTime = 30 * time.Second
)

// Node is this process's membership in the cluster. All methods are safe for concurrent use.
type Node struct {
	cfg  Config
	log  *zap.Logger
	ml   *memberlist.Memberlist
	keys derivedKeys

	events   chan Event
	evSignal chan struct{} // wakes the event pump (new event or leave notice)
	stepKick chan struct{} // wakes the step-metadata loop
	done     chan struct{} // closed by Close: stops owned goroutines, fails waiters
	wg       sync.WaitGroup

	closeOnce sync.Once
	closeErr  error

	mu struct {
		sync.Mutex
		closed    bool
		killed    bool // test hook: memberlist shut down without a leave
		meta      Meta
		metaBytes []byte
		queue     []rawEvent
		dropped   int
		members   map[string]memberEntry // live members by name, this node included
		selfAddr  string                 // our gossip address, as advertised
		leaving   map[string]leaveIntent // node name → its leave notice
		joining   bool                   // a Join is in progress: record refusals for it
		refusal   error                  // the last refusal by our merge delegate during Join
		suspects  suspicion              // what this member reports to a re-forming coordinator
		nameTaken error                  // ErrNameTaken found during Join: never leave under that name
		refused   map[string]bool        // name+metadata of nodes already logged as refused
		changed   chan struct{}          // closed and replaced on every membership change
		roster    rosterState
	}
}

type rawEvent struct {
	kind   EventKind // Joined, Updated, or Left meaning "departed, classify later"
	member Member
	gen    uint64
	at     time.Time
}

type leaveIntent struct {
	gen uint64
	at  time.Time
}

// New creates the node's memberlist — listening on cfg.Bind, gossip encrypted with
// cfg.Key — but does not join anyone: call Join, or wait to be joined (the coordinator).
// meta describes this node; Version defaults to internal/version.Version, Gen to the
// current time in nanoseconds, Rank is always -1 until a roster assigns one, and TLS is
// cfg.TLS's CA fingerprint.
func New(cfg Config, meta Meta, log *zap.Logger) (*Node, error) {
	if log == nil {
		log = zap.NewNop()
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := ValidateKey(cfg.Key); err != nil {
		return nil, fieldError{field: "key", err: err}
	}
	if meta.Version == "" {
		meta.Version = version.Version
	}
	if meta.Gen == 0 {
		meta.Gen = uint64(time.Now().UnixNano())
	}
	meta.Rank = -1
	meta.TLS = ""
	if cfg.TLS != nil {
		meta.TLS = cfg.TLS.Fingerprint()
	}
	metaBytes, err := meta.encode()
	if err != nil {
		return nil, fmt.Errorf("cluster: node %s: %w", cfg.NodeName, err)
	}

	n := &Node{
		cfg:      cfg,
		log:      log.With(zap.String("node", cfg.NodeName)),
		keys:     deriveKeys(cfg.Key),
		events:   make(chan Event, eventChanCap),
		evSignal: make(chan struct{}, 1),
		stepKick: make(chan struct{}, 1),
		done:     make(chan struct{}),
	}
	n.mu.meta = meta
	n.mu.metaBytes = metaBytes
	n.mu.members = make(map[string]memberEntry)
	n.mu.leaving = make(map[string]leaveIntent)
	n.mu.refused = make(map[string]bool)
	n.mu.changed = make(chan struct{})
	n.mu.roster.init()

	mlc, err := n.memberlistConfig()
	if err != nil {
		return nil, err
	}
	// Create calls our delegates (NodeMeta, NotifyAlive, NotifyJoin for ourselves), which
	// only touch n.mu, never n.ml.
	ml, err := memberlist.Create(mlc)
	if err != nil {
		return nil, fmt.Errorf("cluster: start gossip on %s: %w", cfg.Bind, err)
	}
	n.ml = ml
	n.goFunc(n.pumpEvents)
	n.goFunc(n.stepLoop)
	n.log.Debug("gossip started", zap.String("addr", n.LocalAddr()), zap.String("role", meta.Role))
	return n, nil
}

func (n *Node) memberlistConfig() (*memberlist.Config, error) {
	cfg := n.cfg
	bindIP, bindPort, _ := splitIPPort(cfg.Bind) // validated
	c := memberlist.DefaultLANConfig()
	c.Name = cfg.NodeName
	c.BindAddr = bindIP.String()
	c.BindPort = bindPort
	c.AdvertisePort = bindPort
	if cfg.Advertise != "" {
		ip, port, _ := splitIPPort(cfg.Advertise)
		c.AdvertiseAddr = ip.String()
		c.AdvertisePort = port
	}
	g := cfg.Gossip
	c.ProbeInterval = g.ProbeInterval
	c.ProbeTimeout = g.ProbeTimeout
	c.GossipInterval = g.GossipInterval
	c.PushPullInterval = g.PushPullInterval
	c.TCPTimeout = g.TCPTimeout
	c.SuspicionMult = g.SuspicionMult
	c.SuspicionMaxTimeoutMult = suspicionMaxTimeoutMult
	// Gossip to the dead for as long as a push/pull period, so a member wrongly declared
	// dead learns of it and refutes.
	c.GossipToTheDeadTime = g.PushPullInterval
	// A process that keeps an explicit node name but comes back at another address (a
	// rescheduled container) may reclaim the name once its predecessor has been dead this
	// long; memberlist's default is never.
	c.DeadNodeReclaimTime = deadNodeReclaimTime

	keyring, err := memberlist.NewKeyring(nil, cfg.Key)
	if err != nil {
		return nil, fmt.Errorf("%w: cluster.key: %w", ErrConfig, err)
	}
	c.Keyring = keyring
	// Refuse unencrypted traffic both ways: a node without the key must not join.
	c.GossipVerifyIncoming = true
	c.GossipVerifyOutgoing = true

	d := &delegates{n: n}
	c.Delegate = d
	c.Events = d
	c.Alive = d
	c.Merge = d
	c.Conflict = d
	c.Logger = newMLLogger(n.log)
	c.LogOutput = nil
	return c, nil
}

// goFunc runs f on a goroutine that Close waits for; it refuses once Close has begun.
func (n *Node) goFunc(f func()) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.mu.closed {
		return false
	}
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		f()
	}()
	return true
}

// LocalName returns this node's name.
func (n *Node) LocalName() string { return n.cfg.NodeName }

// LocalAddr returns this node's gossip address, ip:port, as others see it (with the port
// memberlist picked when Bind's port was 0).
func (n *Node) LocalAddr() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mu.selfAddr
}

// LocalMeta returns a copy of this node's current metadata.
func (n *Node) LocalMeta() Meta {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mu.meta
}

// Join contacts the given peers (gossip addresses, ip:port) and merges with their cluster;
// one reachable peer suffices. It fails with ErrKeyMismatch when the peer cannot decrypt
// our gossip or we cannot decrypt its reply, and with ErrIncompatibleVersion when the
// cluster runs another major.minor of qvd. If ctx ends first, Join returns its error while
// memberlist's own attempt finishes in the background within gossip.tcp_timeout per peer;
// close the node in that case.
func (n *Node) Join(ctx context.Context, peers ...string) error {
	if len(peers) == 0 {
		return fmt.Errorf("%w: no peer address given", ErrJoin)
	}
	n.mu.Lock()
	n.mu.joining, n.mu.refusal = true, nil
	n.mu.Unlock()
	defer func() {
		n.mu.Lock()
		n.mu.joining = false
		n.mu.Unlock()
	}()

	type result struct {
		joined int
		err    error
	}
	res := make(chan result, 1)
	if !n.goFunc(func() {
		k, err := n.ml.Join(peers)
		res <- result{k, err}
	}) {
		return ErrClosed
	}
	var r result
	select {
	case r = <-res:
	case <-ctx.Done():
		return fmt.Errorf("join %s: %w", strings.Join(peers, ", "), context.Cause(ctx))
	case <-n.done:
		return ErrClosed
	}

	n.mu.Lock()
	refusal, taken := n.mu.refusal, n.mu.nameTaken
	n.mu.Unlock()
	if taken != nil {
		// memberlist counts the join as done, but the cluster ignores this node: it keeps
		// the member that had the name first.
		return fmt.Errorf("join %s: %w", strings.Join(peers, ", "), taken)
	}
	if r.err != nil || r.joined == 0 {
		if refusal != nil {
			return fmt.Errorf("join %s: %w", strings.Join(peers, ", "), refusal)
		}
		msg := flattenJoinError(r.err)
		if len(peers) == 1 {
			if why := n.notQVD(peers[0], msg); why != "" {
				return fmt.Errorf("join %s: %w", peers[0], &notQVDError{peer: peers[0], why: why, detail: msg})
			}
		}
		if isKeyMismatch(msg) {
			return fmt.Errorf("join %s: %w: the peer refused this node or its reply could not be decrypted; check that both use the same cluster key (%s)",
				strings.Join(peers, ", "), ErrKeyMismatch, msg)
		}
		return fmt.Errorf("join %s: %w: %s", strings.Join(peers, ", "), ErrJoin, msg)
	}
	// Our merge delegate refuses incompatible clusters during the join; this second look
	// catches a member that was merged passively (e.g. learnt from another member's gossip).
	if err := n.checkVersions(); err != nil {
		return fmt.Errorf("join %s: %w", strings.Join(peers, ", "), err)
	}
	n.log.Info("joined cluster", zap.Strings("peers", peers), zap.Int("members", n.ml.NumMembers()))
	return nil
}

var _ memberlist.ConflictDelegate = (*delegates)(nil)

// NotifyConflict: memberlist heard of a node named like a live member but at another
// address, and ignores it (the member that had the name first keeps it). On the node that
// is joining, with the name another member holds, that makes Join fail with ErrNameTaken at
// once (without it, the newcomer would wait for a roster that never names it); the members
// log the refusal. memberlist calls this with its node lock held.
func (d *delegates) NotifyConflict(existing, other *memberlist.Node) {
	n := d.n
	if existing.Name == n.cfg.NodeName {
		n.mu.Lock()
		joining := n.mu.joining
		if joining && n.mu.nameTaken == nil {
			role := toMember(other, StateAlive).Meta.Role
			if role == "" {
				role = "node"
			}
			n.mu.nameTaken = fmt.Errorf("%w: node name %q is already taken by a %s at %s; give each node its own name",
				ErrNameTaken, n.cfg.NodeName, role, other.Address())
		}
		n.mu.Unlock()
		if joining {
			return
		}
		// We hold the name; other is the newcomer.
		n.logRefusal(other, fmt.Errorf("%w: %q is this node's name", ErrNameTaken, other.Name))
		return
	}
	n.logRefusal(other, fmt.Errorf("%w: %q is the name of the member at %s", ErrNameTaken, other.Name, existing.Address()))
}

// notQVDError is ErrNotQVD for one peer, worded for the user: "HOST:PORT is not a qvd node".
type notQVDError struct{ peer, why, detail string }

func (e *notQVDError) Error() string {
	return fmt.Sprintf("%s is not a qvd node: %s (%s)", e.peer, e.why, e.detail)
}

func (e *notQVDError) Is(target error) bool { return target == ErrNotQVD }

// notQVD says why peer, which failed a join with msg, is not a qvd node, or "" when it may
// be one. A qvd node encrypts every gossip exchange with the cluster key and, on a message
// it cannot read, answers with an encrypted error (which reads as a key mismatch here); so a
// cleartext answer comes from something else. A connection closed without any answer is
// ambiguous — a busy memberlist sheds push/pull requests that way — so such a peer is asked
// an encrypted ping over UDP, which a qvd node with our key answers at once. A peer that
// refuses connections or does not answer in time may be a qvd node still starting (or
// stopped): the caller retries those.
func (n *Node) notQVD(peer, msg string) string {
	m := strings.ToLower(msg)
	if strings.Contains(m, "encryption is configured but remote state is not encrypted") {
		return "it answered in cleartext, not with qvd's encrypted gossip (another service on that port?)"
	}
	if !strings.HasSuffix(m, ": eof") && !strings.Contains(m, "connection reset by peer") {
		return ""
	}
	addr, err := net.ResolveUDPAddr("udp", peer)
	if err != nil {
		return ""
	}
	if _, err := n.ml.Ping("", addr); err == nil {
		return "" // a qvd node with our key: busy, not foreign
	}
	return "it closed the connection without a gossip answer and does not answer gossip pings (another service on that port?)"
}

// flattenJoinError turns memberlist's multierror ("1 error occurred:\n\t* failed to join
// ...") into one line.
func flattenJoinError(err error) string {
	if err == nil {
		return "no peer could be joined"
	}
	if me, ok := err.(interface{ WrappedErrors() []error }); ok {
		var parts []string
		for _, e := range me.WrappedErrors() {
			parts = append(parts, e.Error())
		}
		if len(parts) > 0 {
			return strings.Join(parts, "; ")
		}
	}
	return strings.Join(strings.Fields(err.Error()), " ")
}

func (n *Node) checkVersions() error {
	local := n.LocalMeta()
	for _, m := range n.Members() {
		if m.Name == n.cfg.NodeName {
			continue
		}
		if !Compatible(m.Meta.Version, local.Version) {
			return fmt.Errorf("%w: %s", ErrIncompatibleVersion, versionMismatch(m.Meta.Role, m.Name, m.Addr, m.Meta.Version, local.Version))
		}
		if m.Meta.TLS != local.TLS {
			return fmt.Errorf("%w: %s", ErrTLSMismatch, tlsMismatch(m.Meta.Role, m.Name, m.Addr, m.Meta.TLS, local.TLS))
		}
	}
	return nil
}

func versionMismatch(role, name, addr, theirs, ours string) string {
	if role == "" {
		role = "node"
	}
	return fmt.Sprintf("%s %s (%s) runs qvd %s, this node runs qvd %s (major.minor must match)", role, name, addr, theirs, ours)
}

// Members returns the live members, this node included, sorted by name.
func (n *Node) Members() []Member {
	n.mu.Lock()
	out := make([]Member, 0, len(n.mu.members))
	for _, e := range n.mu.members {
		out = append(out, e.member)
	}
	n.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// memberEntry is this node's copy of a live member. memberlist's own Members() hands out
// pointers into state it keeps mutating under its lock, so we copy each node while
// memberlist holds that lock — in the event delegate — and answer from the copy.
type memberEntry struct {
	member Member
	ip     []byte // for SendReliable
	port   uint16
}

// observe keeps the member table; memberlist calls it (through the event delegate) with its
// node lock held, for us too.
func (n *Node) observe(kind EventKind, nd *memberlist.Node) Member {
	m := toMember(nd, StateAlive)
	n.mu.Lock()
	defer n.mu.Unlock()
	if kind == Left {
		delete(n.mu.members, nd.Name)
	} else {
		n.mu.members[nd.Name] = memberEntry{member: m, ip: slices.Clone(nd.Addr), port: nd.Port}
		if nd.Name == n.cfg.NodeName {
			n.mu.selfAddr = m.Addr
		}
	}
	return m
}

func toMember(nd *memberlist.Node, state string) Member {
	meta, err := decodeMeta(nd.Meta)
	if err != nil {
		// Our alive delegate refuses such nodes, so this is only ever our own view of a
		// peer that changed its metadata to something unreadable; keep it visible.
		meta = Meta{Rank: -1}
	}
	return Member{Name: nd.Name, Addr: nd.Address(), State: state, Meta: meta}
}

// Events delivers changes of other members, observers included: Joined, Updated, Left
// (the member closed its Node) and Failed (the failure detector declared it dead; the
// event's Member.Meta.Rank names the lost rank). A Failed event comes leaveIntentGrace
// (250ms) after memberlist's verdict, the time a late leave notice is given to arrive. The
// channel is closed by Close. Read it promptly: events queue without bound, except Updated,
// which is dropped past 4096 queued.
func (n *Node) Events() <-chan Event { return n.events }

// UpdateMeta changes this node's metadata and gossips it. Version, Gen and Role cannot be
// changed. It waits (at most gossip.tcp_timeout) until the update has been gossiped; if
// that times out the update still spreads by anti-entropy, so that is not an error.
func (n *Node) UpdateMeta(f func(*Meta)) error {
	n.mu.Lock()
	if n.mu.closed {
		n.mu.Unlock()
		return ErrClosed
	}
	m := n.mu.meta
	f(&m)
	old := n.mu.meta
	m.TLS = old.TLS // fixed by Config.TLS
	if m.Version != old.Version || m.Gen != old.Gen || m.Role != old.Role {
		n.mu.Unlock()
		return fmt.Errorf("%w: version, gen and role cannot change (from %s/%d/%s to %s/%d/%s)",
			ErrBadMeta, old.Version, old.Gen, old.Role, m.Version, m.Gen, m.Role)
	}
	b, err := m.encode()
	if err != nil {
		n.mu.Unlock()
		return fmt.Errorf("update metadata of %s: %w", n.cfg.NodeName, err)
	}
	n.mu.meta, n.mu.metaBytes = m, b
	n.mu.Unlock()
	n.pushMeta()
	return nil
}

// SetStep records the training step for `qvd status`. It never blocks: the step is
// gossiped at most once per Config.StepInterval, and the latest value always goes out.
func (n *Node) SetStep(step int64) {
	if step < 0 {
		return
	}
	n.setProgress(func(m *Meta) bool {
		changed := m.Step != step
		m.Step = step
		return changed
	})
}

// SetModelBytes records the bytes the member holds for training, for `qvd status`; gossiped
// like the step.
func (n *Node) SetModelBytes(b uint64) {
	n.setProgress(func(m *Meta) bool {
		changed := m.ModelBytes != b
		m.ModelBytes = b
		return changed
	})
}

// setProgress applies update to the metadata and kicks the rate-limited gossip if it changed.
func (n *Node) setProgress(update func(*Meta) bool) {
	n.mu.Lock()
	m := n.mu.meta
	if n.mu.closed || !update(&m) {
		n.mu.Unlock()
		return
	}
	if b, err := m.encode(); err == nil {
		n.mu.meta, n.mu.metaBytes = m, b
	}
	n.mu.Unlock()
	select {
	case n.stepKick <- struct{}{}:
	default:
	}
}

func (n *Node) stepLoop() {
	var last time.Time
	for {
		select {
		case <-n.done:
			return
		case <-n.stepKick:
		}
		if wait := n.cfg.StepInterval - time.Since(last); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-n.done:
				t.Stop()
				return
			case <-t.C:
			}
		}
		last = time.Now()
		n.pushMeta()
	}
}

func (n *Node) pushMeta() {
	n.mu.Lock()
	stop := n.mu.closed || n.mu.killed
	n.mu.Unlock()
	if stop {
		return
	}
	if err := n.ml.UpdateNode(n.cfg.Gossip.TCPTimeout); err != nil {
		n.log.Debug("metadata update not yet gossiped; anti-entropy will carry it", zap.Error(err))
	}
}

// changedCh returns a channel closed at the next membership change.
func (n *Node) changedCh() <-chan struct{} {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mu.changed
}

// enqueue must not block: memberlist calls it with its node lock held.
func (n *Node) enqueue(ev rawEvent) {
	n.mu.Lock()
	close(n.mu.changed)
	n.mu.changed = make(chan struct{})
	if ev.kind == Updated && len(n.mu.queue) >= maxQueuedEvents {
		n.mu.dropped++
		n.mu.Unlock()
		return
	}
	n.mu.queue = append(n.mu.queue, ev)
	n.mu.Unlock()
	n.signalPump()
}

func (n *Node) signalPump() {
	select {
	case n.evSignal <- struct{}{}:
	default:
	}
}

// pumpEvents delivers queued events in order. A departure is held until its leave notice
// has arrived (Left) or leaveIntentGrace has passed (Failed).
func (n *Node) pumpEvents() {
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		n.mu.Lock()
		if n.mu.dropped > 0 {
			n.log.Warn("dropped member update events: nobody reads Events", zap.Int("dropped", n.mu.dropped))
			n.mu.dropped = 0
		}
		if len(n.mu.queue) == 0 {
			n.mu.Unlock()
			select {
			case <-n.evSignal:
				continue
			case <-n.done:
				return
			}
		}
		ev := n.mu.queue[0]
		out := Event{Kind: ev.kind, Member: ev.member}
		if ev.kind == Left {
			intent, ok := n.mu.leaving[ev.member.Name]
			switch {
			case ok && intent.gen == ev.gen:
				delete(n.mu.leaving, ev.member.Name)
				out.Member.State = StateLeft
			case time.Since(ev.at) < leaveIntentGrace:
				wait := leaveIntentGrace - time.Since(ev.at)
				n.mu.Unlock()
				if timer == nil {
					timer = time.NewTimer(wait)
				} else {
					timer.Reset(wait)
				}
				select {
				case <-timer.C:
				case <-n.evSignal:
					// Since Go 1.23 a stopped timer never delivers a stale value, so
					// Stop needs no drain and the next Reset starts clean.
					timer.Stop()
				case <-n.done:
					return
				}
				continue
			default:
				out.Kind = Failed
				out.Member.State = StateDead
			}
		}
		n.mu.queue[0] = rawEvent{}
		n.mu.queue = n.mu.queue[1:]
		if len(n.mu.queue) == 0 {
			n.mu.queue = nil // let the backing array go
		}
		n.mu.Unlock()

		switch out.Kind {
		case Left:
			n.log.Info("member left", zap.String("member", out.Member.Name), zap.String("addr", out.Member.Addr), zap.Int("rank", out.Member.Meta.Rank))
		case Failed:
			n.log.Warn("member failed", zap.String("member", out.Member.Name), zap.String("addr", out.Member.Addr), zap.Int("rank", out.Member.Meta.Rank))
		case Joined:
			n.log.Info("member joined", zap.String("member", out.Member.Name), zap.String("addr", out.Member.Addr), zap.String("role", out.Member.Meta.Role))
		}
		select {
		case n.events <- out:
		case <-n.done:
			return
		}
	}
}

// leaveNotice is the user message a closing node sends to every peer before leaving.
const msgLeaving byte = 'L'

func (n *Node) noteLeaving(name string, gen uint64) {
	n.mu.Lock()
	now := time.Now()
	for k, v := range n.mu.leaving {
		if now.Sub(v.at) > leaveIntentTTL {
			delete(n.mu.leaving, k)
		}
	}
	n.mu.leaving[name] = leaveIntent{gen: gen, at: now}
	n.mu.Unlock()
	n.signalPump()
}

// sendLeaveNotices tells every live peer, over memberlist's encrypted TCP messages, that
// this node is leaving on purpose, so that they report Left rather than Failed. Each send
// is bounded by gossip.tcp_timeout.
func (n *Node) sendLeaveNotices() {
	meta := n.LocalMeta()
	msg := append([]byte{msgLeaving}, encodeLeaveNotice(n.cfg.NodeName, meta.Gen)...)
	var wg sync.WaitGroup
	n.mu.Lock()
	var peers []*memberlist.Node
	for name, e := range n.mu.members {
		if name != n.cfg.NodeName {
			peers = append(peers, &memberlist.Node{Name: name, Addr: e.ip, Port: e.port})
		}
	}
	n.mu.Unlock()
	for _, nd := range peers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := n.ml.SendReliable(nd, msg); err != nil {
				n.log.Debug("leave notice not delivered", zap.String("member", nd.Name), zap.Error(err))
			}
		}()
	}
	wg.Wait()
}

func encodeLeaveNotice(name string, gen uint64) []byte {
	b := strconv.AppendUint(nil, gen, 10)
	b = append(b, ' ')
	return append(b, name...)
}

func decodeLeaveNotice(b []byte) (string, uint64, error) {
	genStr, name, ok := strings.Cut(string(b), " ")
	if !ok || name == "" {
		return "", 0, errors.New("malformed leave notice")
	}
	gen, err := strconv.ParseUint(genStr, 10, 64)
	if err != nil {
		return "", 0, fmt.Errorf("malformed leave notice: %w", err)
	}
	return name, gen, nil
}

// Close leaves the cluster gracefully — peers report Left — within gossip.tcp_timeout,
// then shuts the gossip layer down and stops every goroutine the node owns. Rosters being
// awaited fail with ErrClosed. Safe to call more than once; later calls return the first
// call's result.
func (n *Node) Close() error {
	n.closeOnce.Do(func() { n.closeErr = n.close() })
	return n.closeErr
}

func (n *Node) close() error {
	n.mu.Lock()
	n.mu.closed = true
	// A node refused for its name must not leave either: its leave would be taken for the
	// departure of the member that holds the name.
	killed := n.mu.killed || n.mu.nameTaken != nil
	n.mu.Unlock()

	var leaveErr error
	// Leave waits until its broadcast reaches someone; with no other live member (they
	// have all left already, as at the end of a job) there is no one to tell.
	if !killed && len(n.Members()) > 1 {
		n.sendLeaveNotices()
		// The leave broadcast rides the next gossip rounds (every gossip_interval); if it is
		// not out within a few of them, the other members are most likely leaving too (the
		// end of a job), and they already got the leave notice above.
		if err := n.ml.Leave(min(n.cfg.Gossip.TCPTimeout, 5*n.cfg.Gossip.GossipInterval+500*time.Millisecond)); err != nil {
			leaveErr = fmt.Errorf("cluster: leave %s: %w", n.cfg.NodeName, err)
			n.log.Info("leave broadcast not confirmed (peers that missed the leave notice will see a failure)", zap.Error(err))
		}
	}
	if err := n.ml.Shutdown(); err != nil && leaveErr == nil {
		leaveErr = fmt.Errorf("cluster: shut down gossip of %s: %w", n.cfg.NodeName, err)
	}
	close(n.done)
	n.wg.Wait()
	close(n.events)
	return leaveErr
}

// kill stops gossip without leaving, as if the process had died. Tests only.
func (n *Node) kill() {
	n.mu.Lock()
	n.mu.killed = true
	n.mu.Unlock()
	_ = n.ml.Shutdown()
}
