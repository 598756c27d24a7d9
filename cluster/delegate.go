package cluster

import (
	"bytes"
	"fmt"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// delegates receives memberlist's callbacks. memberlist calls them from its own goroutines,
// several with its node lock held: they only take n.mu (never calling back into memberlist)
// and never block.
type delegates struct{ n *Node }

var (
	_ memberlist.Delegate      = (*delegates)(nil)
	_ memberlist.EventDelegate = (*delegates)(nil)
	_ memberlist.AliveDelegate = (*delegates)(nil)
	_ memberlist.MergeDelegate = (*delegates)(nil)
)

// refusedMarker starts the errors our delegates hand memberlist, so that the log bridge can
// tell memberlist's echo of them from other problems (we log each refusal once ourselves).
const refusedMarker = "refused by qvd"

// NodeMeta returns our metadata, which encode has already held to memberlist's limit.
func (d *delegates) NodeMeta(limit int) []byte {
	d.n.mu.Lock()
	defer d.n.mu.Unlock()
	if len(d.n.mu.metaBytes) > limit {
		return nil // unreachable: encode enforces memberlist.MetaMaxSize
	}
	return bytes.Clone(d.n.mu.metaBytes)
}

// NotifyMsg receives user messages; the only one is a peer's leave notice.
func (d *delegates) NotifyMsg(b []byte) {
	if len(b) == 0 {
		return
	}
	switch b[0] {
	case msgLeaving:
		name, gen, err := decodeLeaveNotice(b[1:])
		if err != nil {
			d.n.log.Debug("ignoring bad gossip message", zap.Error(err))
			return
		}
		d.n.noteLeaving(name, gen)
	default:
		d.n.log.Debug("ignoring unknown gossip message", zap.Uint8("type", b[0]))
	}
}

func (d *delegates) GetBroadcasts(overhead, limit int) [][]byte { return nil }
func (d *delegates) LocalState(join bool) []byte                { return nil }
func (d *delegates) MergeRemoteState(buf []byte, join bool)     {}

func (d *delegates) NotifyJoin(nd *memberlist.Node) { d.event(Joined, nd) }

func (d *delegates) NotifyUpdate(nd *memberlist.Node) { d.event(Updated, nd) }

// NotifyLeave covers graceful leaves and deaths alike (memberlist does not say which on
// this path); the event pump tells them apart by the leave notice.
func (d *delegates) NotifyLeave(nd *memberlist.Node) { d.event(Left, nd) }

func (d *delegates) event(kind EventKind, nd *memberlist.Node) {
	m := d.n.observe(kind, nd)
	if nd.Name == d.n.cfg.NodeName {
		return
	}
	d.n.enqueue(rawEvent{kind: kind, member: m, gen: m.Meta.Gen, at: time.Now()})
}

// NotifyAlive vets every alive message, so an incompatible or foreign node is never
// admitted, even when it arrives by gossip rather than through a join.
func (d *delegates) NotifyAlive(peer *memberlist.Node) error {
	if peer.Name == d.n.cfg.NodeName {
		return nil
	}
	if err := d.n.admit(peer); err != nil {
		d.n.logRefusal(peer, err)
		return fmt.Errorf("%s: %w", refusedMarker, err)
	}
	return nil
}

// NotifyMerge vets a join, on both sides: the member being joined sees the joiner, the
// joiner sees the whole cluster. Refusing cancels the merge, and the joiner's Join fails.
func (d *delegates) NotifyMerge(peers []*memberlist.Node) error {
	for _, p := range peers {
		if p.Name == d.n.cfg.NodeName || p.State == memberlist.StateDead || p.State == memberlist.StateLeft {
			continue
		}
		err := d.n.admit(p)
		if err == nil {
			continue
		}
		d.n.mu.Lock()
		joining := d.n.mu.joining
		if joining {
			d.n.mu.refusal = err
		}
		d.n.mu.Unlock()
		if !joining {
			d.n.logRefusal(p, err)
		}
		return fmt.Errorf("%s: %w", refusedMarker, err)
	}
	return nil
}

// admit decides whether peer may be a member of our cluster.
func (n *Node) admit(peer *memberlist.Node) error {
	meta, err := decodeMeta(peer.Meta)
	if err != nil {
		return fmt.Errorf("node %s (%s) has unreadable metadata (not a qvd node of this version?): %w", peer.Name, peer.Address(), err)
	}
	local := n.LocalMeta()
	if !Compatible(meta.Version, local.Version) {
		return fmt.Errorf("%w: %s", ErrIncompatibleVersion, versionMismatch(meta.Role, peer.Name, peer.Address(), meta.Version, local.Version))
	}
	if meta.TLS != local.TLS {
		return fmt.Errorf("%w: %s", ErrTLSMismatch, tlsMismatch(meta.Role, peer.Name, peer.Address(), meta.TLS, local.TLS))
	}
	return nil
}

// tlsMismatch describes a peer whose TLS setup differs from ours.
func tlsMismatch(role, name, addr, theirs, ours string) string {
	if role == "" {
		role = "node"
	}
	describe := func(fp string) string {
		if fp == "" {
			return "no TLS"
		}
		return "mutual TLS with CA " + fp
	}
	return fmt.Sprintf("%s %s (%s) uses %s, this node uses %s (every node needs the same --tls-ca, and a certificate it signed)",
		role, name, addr, describe(theirs), describe(ours))
}

// logRefusal warns once per node name and metadata: memberlist re-delivers a refused
// node's alive message with every gossip round.
func (n *Node) logRefusal(peer *memberlist.Node, err error) {
	key := peer.Name + "\x00" + string(peer.Meta)
	n.mu.Lock()
	seen := n.mu.refused[key]
	if !seen {
		if len(n.mu.refused) >= 1024 {
			clear(n.mu.refused)
		}
		n.mu.refused[key] = true
	}
	n.mu.Unlock()
	if !seen {
		n.log.Warn("refusing node", zap.String("member", peer.Name), zap.String("remote_addr", peer.Address()), zap.Error(err))
	}
}
