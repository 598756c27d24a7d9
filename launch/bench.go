package launch

import (
	"fmt"
	"os/exec"
	"slices"
)

// Bench is a launch of NProc local workers of `qvd bench`: each runs Args (the subcommand
// and the flags every worker takes) with its node name, bind addresses and, but for the
// global rank 0 that coordinates, the coordinator's address. Node names bench-<global rank>
// sort in rank order, so node R's workers are ranks R·NProc and up, as Train places them.
type Bench struct {
	Exe   string   // the qvd binary
	Env   []string // the workers' environment
	Nodes Nodes
	Place Placement
	NProc int
	Args  []string
}

// Workers builds the commands of this node's workers.
func (b Bench) Workers() []*Worker {
	workers := make([]*Worker, b.NProc)
	for i := range workers {
		rank := b.Nodes.NodeRank*b.NProc + i
		bind, grpcBind := b.Place.Addrs(rank)
		a := append(slices.Clone(b.Args), "--node-name", fmt.Sprintf("bench-%03d", rank), "--bind", bind, "--grpc-bind", grpcBind)
		if rank != 0 {
			a = append(a, "--join", b.Place.Coord)
		}
		workers[i] = &Worker{Rank: rank, Cmd: exec.Command(b.Exe, a...)}
		workers[i].Cmd.Env = b.Env
	}
	return workers
}
