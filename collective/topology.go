package collective

import (
	"errors"
	"fmt"
	"strings"
)

// Topology is where the ranks of a world sit: which share a host (memory), and the two
// groups a hierarchical communicator runs in. Hosts are numbered in the order of their first
// rank, so every rank computes the same numbering from the same roster.
type Topology struct {
	Rank, Size int
	// Local are the global ranks on this rank's host, ascending; LocalRank is this rank's
	// index in it.
	Local     []int
	LocalRank int
	// Cross are the global ranks with this rank's LocalRank, one per host that has such a
	// rank, in host order; CrossRank is this rank's index in it (its host's number when the
	// topology is Uniform).
	Cross     []int
	CrossRank int
	// Uniform: every host has the same number of ranks, which the hierarchical communicator
	// needs (otherwise a host's cross group would be missing members).
	Uniform bool
	// HostOf is the host number of every global rank; Hosts is the id of every host.
	HostOf []int
	Hosts  []string
}

// NewTopology computes rank's Topology from the host id of every rank (cluster.HostID, in
// rank order). An empty id means unknown: that rank is taken to be alone on its host, since
// sharing memory with a process on another machine would fail.
func NewTopology(hosts []string, rank int) (Topology, error) {
	n := len(hosts)
	if n == 0 {
		return Topology{}, errors.New("collective: topology of an empty world")
	}
	if rank < 0 || rank >= n {
		return Topology{}, fmt.Errorf("collective: rank %d outside a world of %d", rank, n)
	}
	t := Topology{Rank: rank, Size: n, HostOf: make([]int, n), Uniform: true}
	index := make(map[string]int, n)
	var members [][]int // global ranks of each host, ascending
	for r, id := range hosts {
		h, ok := index[id]
		if !ok || id == "" {
			h = len(t.Hosts)
			t.Hosts = append(t.Hosts, id)
			members = append(members, nil)
			if id != "" {
				index[id] = h
			}
		}
		t.HostOf[r] = h
		members[h] = append(members[h], r)
	}
	t.Local = members[t.HostOf[rank]]
	for i, r := range t.Local {
		if r == rank {
			t.LocalRank = i
		}
	}
	for h, m := range members {
		if len(m) != len(members[0]) {
			t.Uniform = false
		}
		if t.LocalRank < len(m) {
			if h == t.HostOf[rank] {
				t.CrossRank = len(t.Cross)
			}
			t.Cross = append(t.Cross, m[t.LocalRank])
		}
	}
	return t, nil
}

// members returns the global ranks of every host, ascending (host h's local rank l is
// members[h][l]).
func (t Topology) members() [][]int {
	m := make([][]int, len(t.Hosts))
	for r, h := range t.HostOf {
		m[h] = append(m[h], r)
	}
	return m
}

// describe lists the hosts and their ranks for error messages: "host 0 (ab12…) has ranks
// [0 1], host 1 (unknown id) has rank [2]".
func (t Topology) describe() string {
	var b strings.Builder
	for h, m := range t.members() {
		if h > 0 {
			b.WriteString(", ")
		}
		id := t.Hosts[h]
		if id == "" {
			id = "unknown id"
		}
		fmt.Fprintf(&b, "host %d (%s) has ranks %v", h, id, m)
	}
	return b.String()
}

// Plan is the data plane a world's collectives run on.
type Plan string

// Plans ChooseTransport picks from.
const (
	// PlanShm: one ring over shared memory; every rank is on one host.
	PlanShm Plan = TransportShm
	// PlanTCP: one ring over raw TCP.
	PlanTCP Plan = TransportTCP
	// PlanGRPC: one ring over the cluster's gRPC streams.
	PlanGRPC Plan = TransportGRPC
	// PlanHierarchical: NewHierarchical over a shared-memory ring within each host and a
	// TCP ring per local rank across hosts.
	PlanHierarchical Plan = "hierarchical"
)

// ChooseTransport decides the data plane for a `collective.transport` setting: "tcp" and
// "grpc" are taken as given; "shm" is shared memory, which must then be possible; "auto"
// uses shared memory where ranks share a host, TCP between hosts:
//
//   - every rank on one host: PlanShm;
//   - several hosts, each with the same number (> 1) of ranks: PlanHierarchical;
//   - one rank per host: PlanTCP (nothing to share);
//   - hosts with different numbers of ranks: PlanTCP (a hierarchical all-reduce needs a
//     full cross ring per local rank);
//   - shared memory unavailable here (shmErr, e.g. no /dev/shm or no host id): PlanTCP.
//
// reason says why, for the log. shmErr must be the same on every rank's call, or ranks may
// choose differently: a rank that cannot use shared memory should publish an empty host id,
// which makes it a host of its own in every rank's Topology.
func ChooseTransport(requested string, t Topology, shmErr error) (plan Plan, reason string, err error) {
	hosts := len(t.Hosts)
	switch requested {
	case TransportTCP, TransportGRPC:
		return Plan(requested), "requested by collective.transport", nil
	case TransportShm:
		switch {
		case shmErr != nil:
			return "", "", fmt.Errorf("collective.transport shm: shared memory is unavailable on rank %d: %w", t.Rank, shmErr)
		case hosts > 1:
			return "", "", fmt.Errorf("collective.transport shm needs every rank on one host, but the %d ranks are on %d hosts: %s (use auto to combine shared memory with TCP)",
				t.Size, hosts, t.describe())
		}
		return PlanShm, "requested by collective.transport", nil
	case TransportAuto:
	default:
		return "", "", fmt.Errorf("collective.transport: must be auto, shm, tcp or grpc, got %q", requested)
	}
	switch {
	case shmErr != nil:
		return PlanTCP, fmt.Sprintf("shared memory unavailable: %v", shmErr), nil
	case hosts == 1:
		return PlanShm, fmt.Sprintf("all %d ranks on one host", t.Size), nil
	case hosts == t.Size:
		return PlanTCP, fmt.Sprintf("one rank on each of %d hosts", hosts), nil
	case !t.Uniform:
		return PlanTCP, fmt.Sprintf("hosts have different numbers of ranks (%s): hierarchical needs the same number on each", t.describe()), nil
	}
	return PlanHierarchical, fmt.Sprintf("%d hosts with %d ranks each: shared memory within a host, TCP across", hosts, len(t.Local)), nil
}
