package collective

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

func TestPieces(t *testing.T) {
	for _, c := range []struct{ n, chunk, want int }{
		{0, 4, 1}, {1, 4, 1}, {4, 4, 1}, {5, 4, 2}, {8, 4, 2}, {9, 4, 3}, {1 << 20, 1 << 17, 8},
	} {
		if got := pieces(c.n, c.chunk); got != c.want {
			t.Errorf("pieces(%d, %d) = %d, want %d", c.n, c.chunk, got, c.want)
		}
	}
	sp := span{lo: 10, hi: 19}
	var got [][2]int
	for p := range pieces(sp.hi-sp.lo, 4) {
		lo, hi := pieceBounds(sp, p, 4)
		got = append(got, [2]int{lo, hi})
	}
	if want := [][2]int{{10, 14}, {14, 18}, {18, 19}}; !slices.Equal(got, want) {
		t.Errorf("pieces of [10, 19) by 4 = %v, want %v", got, want)
	}
}

func TestEvenShardsInto(t *testing.T) {
	for size := 1; size <= 7; size++ {
		for n := range 30 {
			if got, want := evenShardsInto(make(Shards, size+1), n, size), EvenShards(n, size); !slices.Equal(got, want) {
				t.Fatalf("evenShardsInto(%d, %d) = %v, want %v", n, size, got, want)
			}
		}
	}
}

// simFrame is a frame in the schedule simulation. Each element is a bit set: for a
// reduction, the ranks whose contributions the value includes; for a copy, the rank whose
// value it is. know is the set of ranks that had entered the call, as far as the sender
// could know when it sent the frame.
type simFrame struct {
	step       uint32
	piece      int
	lo, hi     int
	data       []uint64
	know       uint64
	fromSender int
}

// simulate runs one collective's schedules for every rank with frames delivered in a random
// (seeded) interleaving, and checks every frame against what the receiver expects, that no
// contribution is ever added twice, that nothing deadlocks, and the final contents.
func simulate(t *testing.T, rng *rand.Rand, op uint8, n int, shards Shards, length, root, chunk int) {
	t.Helper()
	all := uint64(1)<<n - 1
	sch := make([]schedule, n)
	data := make([][]uint64, n)
	know := make([]uint64, n)
	owner := func(i int) int {
		for r := range n {
			if i >= shards[r] && i < shards[r+1] {
				return r
			}
		}
		panic("no owner")
	}
	for r := range n {
		sch[r].plan(op, r, n, shards, length, root, chunk)
		data[r] = make([]uint64, length)
		know[r] = 1 << r
		for i := range data[r] {
			switch op {
			case OpAllReduce, OpReduceScatter:
				data[r][i] = 1 << r
			case OpAllGather:
				if owner(i) == r {
					data[r][i] = 1 << r
				}
			case OpBroadcast:
				if r == root {
					data[r][i] = 1 << r
				}
			}
		}
	}
	links := make([][]simFrame, n) // links[r]: frames from r to r+1
	sent, recvd := make([]int, n), make([]int, n)
	scur, rcur := make([][2]int, n), make([][2]int, n) // (span, piece)
	total := func(r int) int { return spanFrames(sch[r].send, chunk) }
	recvTotal := func(r int) int { return spanFrames(sch[r].recv, chunk) }

	canSend := func(r int) bool { return sent[r] < min(total(r), sch[r].initial+recvd[r]) }
	canRecv := func(r int) bool {
		prev := mod(r-1, n)
		if len(links[prev]) == 0 || recvd[r] == recvTotal(r) {
			return false
		}
		return rcur[r][0] < sch[r].gateStep || sch[r].gateStep < 0 || sent[r] >= sch[r].gateFrames
	}
	for {
		var movers []int
		for r := range n {
			if canSend(r) {
				movers = append(movers, r)
			}
			if canRecv(r) {
				movers = append(movers, n+r)
			}
		}
		if len(movers) == 0 {
			break
		}
		m := movers[rng.IntN(len(movers))]
		if m < n { // rank m sends one frame
			r := m
			sp := sch[r].send[scur[r][0]]
			lo, hi := pieceBounds(sp, scur[r][1], chunk)
			links[r] = append(links[r], simFrame{step: sp.step, piece: scur[r][1], lo: lo, hi: hi,
				data: slices.Clone(data[r][lo:hi]), know: know[r], fromSender: r})
			sent[r]++
			if scur[r][1]++; scur[r][1] == pieces(sp.hi-sp.lo, chunk) {
				scur[r] = [2]int{scur[r][0] + 1, 0}
			}
			continue
		}
		r := m - n // rank r receives one frame
		prev := mod(r-1, n)
		f := links[prev][0]
		links[prev] = links[prev][1:]
		si := rcur[r][0]
		sp := sch[r].recv[si]
		lo, hi := pieceBounds(sp, rcur[r][1], chunk)
		if f.step != sp.step || f.piece != rcur[r][1] || f.lo != lo || f.hi != hi {
			t.Fatalf("rank %d got step %d piece %d [%d,%d), expected step %d piece %d [%d,%d)",
				r, f.step, f.piece, f.lo, f.hi, sp.step, rcur[r][1], lo, hi)
		}
		for i, v := range f.data {
			if si < sch[r].reduceSteps {
				if data[r][lo+i]&v != 0 {
					t.Fatalf("rank %d element %d: contributions %b added twice (has %b)", r, lo+i, v, data[r][lo+i])
				}
				data[r][lo+i] |= v
			} else {
				data[r][lo+i] = v
			}
		}
		know[r] |= f.know
		recvd[r]++
		if rcur[r][1]++; rcur[r][1] == pieces(sp.hi-sp.lo, chunk) {
			rcur[r] = [2]int{rcur[r][0] + 1, 0}
		}
	}
	for r := range n {
		if sent[r] != total(r) || recvd[r] != recvTotal(r) || len(links[r]) != 0 {
			t.Fatalf("deadlock: rank %d sent %d of %d, received %d of %d, %d frames undelivered",
				r, sent[r], total(r), recvd[r], recvTotal(r), len(links[r]))
		}
	}
	for r := range n {
		for i, v := range data[r] {
			var want uint64
			switch op {
			case OpAllReduce:
				want = all
			case OpReduceScatter:
				if owner(i) != r {
					continue
				}
				want = all
			case OpAllGather:
				want = 1 << owner(i)
			case OpBroadcast:
				want = 1 << root
			}
			if v != want {
				t.Fatalf("rank %d element %d = %b, want %b", r, i, v, want)
			}
		}
		// Every rank of a reduction or barrier leaves knowing that all ranks entered.
		if op != OpBroadcast && op != OpAllGather && know[r] != all {
			t.Fatalf("rank %d left knowing only ranks %b had entered", r, know[r])
		}
	}
}

func TestScheduleSimulation(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for n := 2; n <= 6; n++ {
		for _, op := range []uint8{OpAllReduce, OpReduceScatter, OpAllGather, OpBroadcast, OpBarrier} {
			for _, length := range []int{0, 1, n - 1, n, 2*n + 1, 37} {
				if op == OpBarrier && length > 0 {
					continue
				}
				for _, chunk := range []int{1, 2, 5, 1000} {
					variants := map[string]Shards{"even": EvenShards(length, n)}
					if op == OpReduceScatter || op == OpAllGather {
						u := make(Shards, n+1)
						for i := 1; i < n; i++ {
							u[i] = rng.IntN(length + 1)
						}
						u[n] = length
						slices.Sort(u)
						variants["uneven"] = u
						e := make(Shards, n+1)
						for i := 1; i <= n; i++ {
							if i > n/2 {
								e[i] = length
							}
						}
						variants["empty"] = e
					}
					roots := []int{0}
					if op == OpBroadcast {
						roots = roots[:0]
						for r := range n {
							roots = append(roots, r)
						}
					}
					for name, shards := range variants {
						for _, root := range roots {
							t.Run(fmt.Sprintf("%s/N=%d/len=%d/chunk=%d/%s/root=%d", opName(op), n, length, chunk, name, root), func(t *testing.T) {
								for range 3 {
									simulate(t, rng, op, n, shards, length, root, chunk)
								}
							})
						}
					}
				}
			}
		}
	}
}

// TestSchedulePipelineRule checks the rule the Ring relies on directly: received frame i
// covers the same region as sent frame initial+i.
func TestSchedulePipelineRule(t *testing.T) {
	for n := 2; n <= 5; n++ {
		for _, op := range []uint8{OpAllReduce, OpReduceScatter, OpAllGather, OpBroadcast} {
			for r := range n {
				var s schedule
				shards := Shards{0, 3, 3, 10, 11, 20}[:n+1]
				shards[n] = 20
				s.plan(op, r, n, shards, 20, 1, 2)
				type reg struct{ lo, hi int }
				var sent, recv []reg
				for _, sp := range s.send {
					for p := range pieces(sp.hi-sp.lo, s.chunk) {
						lo, hi := pieceBounds(sp, p, s.chunk)
						sent = append(sent, reg{lo, hi})
					}
				}
				for _, sp := range s.recv {
					for p := range pieces(sp.hi-sp.lo, s.chunk) {
						lo, hi := pieceBounds(sp, p, s.chunk)
						recv = append(recv, reg{lo, hi})
					}
				}
				for i := range recv {
					if j := s.initial + i; j < len(sent) && sent[j] != recv[i] {
						t.Fatalf("%s N=%d rank %d: received frame %d is %v, but sent frame %d is %v",
							opName(op), n, r, i, recv[i], j, sent[j])
					}
				}
				if len(sent) > 0 && s.initial+len(recv) < len(sent) {
					t.Fatalf("%s N=%d rank %d: %d frames to send, only %d ever ready", opName(op), n, r, len(sent), s.initial+len(recv))
				}
			}
		}
	}
}
