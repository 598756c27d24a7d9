package collective

import (
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestNewTopology(t *testing.T) {
	cases := []struct {
		name  string
		hosts []string
		rank  int
		want  Topology
	}{
		{"one rank", []string{"a"}, 0, Topology{Rank: 0, Size: 1, Local: []int{0}, Cross: []int{0}, Uniform: true,
			HostOf: []int{0}, Hosts: []string{"a"}}},
		{"one host", []string{"a", "a", "a"}, 1, Topology{Rank: 1, Size: 3, Local: []int{0, 1, 2}, LocalRank: 1, Cross: []int{1}, Uniform: true,
			HostOf: []int{0, 0, 0}, Hosts: []string{"a"}}},
		{"one rank per host", []string{"a", "b", "c"}, 2, Topology{Rank: 2, Size: 3, Local: []int{2}, Cross: []int{0, 1, 2}, CrossRank: 2, Uniform: true,
			HostOf: []int{0, 1, 2}, Hosts: []string{"a", "b", "c"}}},
		{"2x2 blocks", []string{"a", "a", "b", "b"}, 3, Topology{Rank: 3, Size: 4, Local: []int{2, 3}, LocalRank: 1, Cross: []int{1, 3}, CrossRank: 1, Uniform: true,
			HostOf: []int{0, 0, 1, 1}, Hosts: []string{"a", "b"}}},
		// Hosts are numbered by their first rank, whatever their ids sort as.
		{"2x2 interleaved", []string{"z", "a", "z", "a"}, 1, Topology{Rank: 1, Size: 4, Local: []int{1, 3}, Cross: []int{0, 1}, CrossRank: 1, Uniform: true,
			HostOf: []int{0, 1, 0, 1}, Hosts: []string{"z", "a"}}},
		{"3x2 mixed order", []string{"b", "c", "b", "a", "c", "a"}, 4, Topology{Rank: 4, Size: 6, Local: []int{1, 4}, LocalRank: 1, Cross: []int{2, 4, 5}, CrossRank: 1, Uniform: true,
			HostOf: []int{0, 1, 0, 2, 1, 2}, Hosts: []string{"b", "c", "a"}}},
		// A host with fewer ranks has no member in the higher local ranks' cross groups.
		{"uneven, local rank 2", []string{"a", "a", "a", "b"}, 2, Topology{Rank: 2, Size: 4, Local: []int{0, 1, 2}, LocalRank: 2, Cross: []int{2}, Uniform: false,
			HostOf: []int{0, 0, 0, 1}, Hosts: []string{"a", "b"}}},
		{"uneven, local rank 0", []string{"a", "a", "a", "b"}, 3, Topology{Rank: 3, Size: 4, Local: []int{3}, Cross: []int{0, 3}, CrossRank: 1, Uniform: false,
			HostOf: []int{0, 0, 0, 1}, Hosts: []string{"a", "b"}}},
		// An unknown host id shares with nobody, not even another unknown one.
		{"unknown ids", []string{"a", "", "a", ""}, 3, Topology{Rank: 3, Size: 4, Local: []int{3}, Cross: []int{0, 1, 3}, CrossRank: 2, Uniform: false,
			HostOf: []int{0, 1, 0, 2}, Hosts: []string{"a", "", ""}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := NewTopology(tc.hosts, tc.rank)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %+v\nwant %+v", got, tc.want)
			}
			// Invariants every rank relies on.
			if got.Local[got.LocalRank] != tc.rank || got.Cross[got.CrossRank] != tc.rank {
				t.Errorf("rank %d is not at Local[%d] / Cross[%d]", tc.rank, got.LocalRank, got.CrossRank)
			}
		})
	}
	for _, bad := range []struct {
		hosts []string
		rank  int
	}{{nil, 0}, {[]string{"a"}, 1}, {[]string{"a"}, -1}} {
		if _, err := NewTopology(bad.hosts, bad.rank); err == nil {
			t.Errorf("NewTopology(%q, %d) accepted it", bad.hosts, bad.rank)
		}
	}
}

func TestChooseTransport(t *testing.T) {
	noShm := errors.New("no /dev/shm")
	cases := []struct {
		name      string
		requested string
		hosts     []string
		shmErr    error
		want      Plan
		reason    string // a substring of the reason, or of the error when want is ""
	}{
		{"auto one host", "auto", []string{"a", "a", "a", "a"}, nil, PlanShm, "all 4 ranks on one host"},
		{"auto one rank", "auto", []string{"a"}, nil, PlanShm, "all 1 ranks"},
		{"auto 2x2", "auto", []string{"a", "a", "b", "b"}, nil, PlanHierarchical, "2 hosts with 2 ranks each"},
		{"auto 3x2 interleaved", "auto", []string{"a", "b", "c", "a", "b", "c"}, nil, PlanHierarchical, "3 hosts with 2 ranks each"},
		{"auto one per host", "auto", []string{"a", "b", "c"}, nil, PlanTCP, "one rank on each of 3 hosts"},
		{"auto unknown ids", "auto", []string{"", ""}, nil, PlanTCP, "one rank on each of 2 hosts"},
		{"auto uneven", "auto", []string{"a", "a", "a", "b"}, nil, PlanTCP, "different numbers of ranks"},
		{"auto no shm", "auto", []string{"a", "a"}, noShm, PlanTCP, "shared memory unavailable: no /dev/shm"},
		{"auto no shm 2x2", "auto", []string{"a", "a", "b", "b"}, noShm, PlanTCP, "unavailable"},
		{"shm one host", "shm", []string{"a", "a"}, nil, PlanShm, "requested"},
		{"shm across hosts", "shm", []string{"a", "a", "b"}, nil, "", "host 0 (a) has ranks [0 1], host 1 (b) has ranks [2]"},
		{"shm unknown id", "shm", []string{"a", ""}, nil, "", "host 1 (unknown id) has ranks [1]"},
		{"shm unavailable", "shm", []string{"a", "a"}, noShm, "", "no /dev/shm"},
		{"tcp", "tcp", []string{"a", "a"}, nil, PlanTCP, "requested"},
		{"grpc", "grpc", []string{"a", "b"}, noShm, PlanGRPC, "requested"},
		{"unknown", "udp", []string{"a"}, nil, "", `must be auto, shm, tcp or grpc, got "udp"`},
		{"empty", "", []string{"a"}, nil, "", "must be auto"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			topo, err := NewTopology(tc.hosts, 0)
			if err != nil {
				t.Fatal(err)
			}
			plan, reason, err := ChooseTransport(tc.requested, topo, tc.shmErr)
			if tc.want == "" {
				if err == nil || !strings.Contains(err.Error(), tc.reason) {
					t.Fatalf("got %q (%s), %v; want an error containing %q", plan, reason, err, tc.reason)
				}
				if tc.shmErr != nil && !errors.Is(err, tc.shmErr) {
					t.Errorf("error %v does not wrap %v", err, tc.shmErr)
				}
				return
			}
			if err != nil || plan != tc.want || !strings.Contains(reason, tc.reason) {
				t.Errorf("got %q (%s), %v; want %q (%s)", plan, reason, err, tc.want, tc.reason)
			}
		})
	}
}
