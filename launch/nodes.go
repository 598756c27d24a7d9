package launch

import (
	"context"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
)

// DefaultPort is the coordinator's gossip port where nothing sets it across machines:
// torchrun's MASTER_PORT default. gRPC listens on the next port.
const DefaultPort = 29500

// Environment variables qvd sets in its local workers' environment.
const (
	// LaunchedEnv marks a worker of qvd launch: the launcher, not its rank 0, prints the
	// command that resumes an interrupted run.
	LaunchedEnv = "QVD_LAUNCHED"
	// LocalRankEnv is the worker's index on its machine, which picks its GPU (device.ordinal -1).
	LocalRankEnv = "QVD_LOCAL_RANK"
)

// Nodes is a launch across machines, one launcher each, as torchrun's static rendezvous:
// launcher NodeRank starts its workers as global ranks NodeRank·nproc and up; node 0's first
// worker coordinates at MasterAddr:MasterPort. The field names are the flags'.
type Nodes struct {
	Host       string // address the workers bind and talk on
	HostSet    bool   // Host was given; else, with NNodes > 1, the address that routes to MasterAddr
	NNodes     int
	NodeRank   int
	MasterAddr string
	MasterPort int // 0: DefaultPort with NNodes > 1, else a free port
}

// Validate checks the fields; haveKey says every launcher shares a cluster key, which a launch
// across machines needs. The errors name the flags.
func (n Nodes) Validate(haveKey bool) error {
	switch {
	case n.NNodes < 1 || n.NNodes > 256:
		return fmt.Errorf("--nnodes must be in [1, 256], got %d", n.NNodes)
	case n.NodeRank < 0 || n.NodeRank >= n.NNodes:
		return fmt.Errorf("--node-rank must be in [0, %d) (--nnodes), got %d", n.NNodes, n.NodeRank)
	case n.MasterPort < 0 || n.MasterPort > 65534:
		return fmt.Errorf("--master-port must be in [1, 65534] (gRPC takes the next port), got %d", n.MasterPort)
	case n.NNodes > 1 && n.MasterAddr == "":
		return errors.New("--nnodes > 1 needs --master-addr, the host of node 0")
	case n.NNodes > 1 && !haveKey:
		return errors.New("--nnodes > 1 needs one cluster key on every node: set QVD_CLUSTER_KEY or --cluster-key-file (make one with `qvd keygen`)")
	}
	return nil
}

// ErrMasterAddr marks a Place error caused by the rendezvous address given (--master-addr),
// as opposed to one of this machine (no free port).
var ErrMasterAddr = errors.New("launch: unusable master address")

type addrError struct{ msg string }

func (e addrError) Error() string        { return e.msg }
func (e addrError) Is(target error) bool { return target == ErrMasterAddr }

// Placement is where a launch's workers meet.
type Placement struct {
	Host      string // what the workers bind (Nodes.Host, or the address routing to MasterAddr)
	Coord     string // the gossip address the workers join
	CoordBind string // what node 0's first worker binds
}

// Addrs are the gossip and gRPC addresses the local worker of global rank binds: rank 0 the
// coordinator's gossip address, every other any free port on Host; gRPC any free port on the
// same host (gossip port + 1 may be taken on a busy machine).
func (p Placement) Addrs(rank int) (bind, grpcBind string) {
	if rank == 0 {
		h, _, _ := net.SplitHostPort(p.CoordBind)
		return p.CoordBind, net.JoinHostPort(h, "0")
	}
	return net.JoinHostPort(p.Host, "0"), net.JoinHostPort(p.Host, "0")
}

// Place decides where the workers meet once n is valid.
func (n Nodes) Place(ctx context.Context) (Placement, error) {
	p := Placement{Host: n.Host}
	port := n.MasterPort
	if port == 0 && n.NNodes > 1 {
		port = DefaultPort
	}
	var err error
	if n.NNodes > 1 && !n.HostSet {
		ip, err := resolveHost(ctx, n.MasterAddr)
		if err == nil {
			p.Host, err = routeFrom(ctx, ip, port)
		}
		if err != nil {
			return p, addrError{fmt.Sprintf("--master-addr %s: %v (or set --host)", n.MasterAddr, err)}
		}
	}
	if port == 0 {
		if port, err = FreePort(p.Host); err != nil {
			return p, err
		}
	}
	p.Coord = net.JoinHostPort(p.Host, strconv.Itoa(port))
	p.CoordBind = p.Coord
	if n.NNodes > 1 {
		p.Coord = net.JoinHostPort(n.MasterAddr, strconv.Itoa(port))
		if n.NodeRank == 0 {
			if p.CoordBind, err = coordinatorBind(ctx, n.MasterAddr, port); err != nil {
				return p, addrError{fmt.Sprintf("--master-addr: %v", err)}
			}
		}
	}
	return p, nil
}

// Train is a launch of NProc local workers of a training job: the global rank 0 runs
// `qvd train` with Args and coordinates NNodes·NProc processes; every other worker runs
// `qvd join`. Node names launch-<global rank> sort in rank order, so the rendezvous (which
// orders members by name) gives worker i of node R the rank R·NProc+i.
type Train struct {
	Exe    string   // the qvd binary
	Env    []string // the workers' environment
	Nodes  Nodes
	Place  Placement
	NProc  int
	Args   []string // the coordinator's train flags
	Common []string // flags of every worker (cluster key file, TLS)
	// MinNodes > 0 makes the job elastic: the coordinator gets --nodes MinNodes:world, and
	// RunElastic lets the survivors of a failed worker go on.
	MinNodes int
	// MaxRestarts (--max-restarts, with MinNodes > 0) restarts failed workers as workers
	// that join the running job (Elastic); call PinBinds first, so that every worker's gossip
	// address is known to join through.
	MaxRestarts int
	// Binds are the local workers' gossip addresses by local index, set by PinBinds; empty,
	// Place.Addrs (every worker but the coordinator picks a free port itself).
	Binds []string
}

// PinBinds picks a free port on Place.Host for each local worker that would pick its own
// (every one but the coordinator), so the launcher knows every worker's gossip address: a
// restart joins the job through a live worker, and binds the address of the one it replaces.
func (t *Train) PinBinds() error {
	t.Binds = make([]string, t.NProc)
	taken := map[string]bool{}
	for i := range t.Binds {
		bind, _ := t.Place.Addrs(t.Nodes.NodeRank*t.NProc + i)
		for try := 0; strings.HasSuffix(bind, ":0") || taken[bind]; try++ {
			if try == 64 {
				return fmt.Errorf("finding %d free ports on %s: %s is taken", t.NProc, t.Place.Host, bind)
			}
			port, err := FreePort(t.Place.Host)
			if err != nil {
				return err
			}
			bind = net.JoinHostPort(t.Place.Host, strconv.Itoa(port))
		}
		t.Binds[i], taken[bind] = bind, true
	}
	return nil
}

// Elastic is RunElastic's policy for this launch: MinNodes, MaxRestarts, and Rejoin. With
// --nnodes > 1 a restart joins through a worker on this machine only, so a machine whose
// workers have all left the job restarts none.
func (t Train) Elastic() Elastic {
	return Elastic{MinAlive: t.MinNodes, MaxRestarts: t.MaxRestarts, Rejoin: t.Rejoin, AllLocal: t.Nodes.NNodes == 1}
}

// Workers builds the commands of this node's workers.
func (t Train) Workers() []*Worker {
	world := t.Nodes.NNodes * t.NProc
	width := max(3, len(strconv.Itoa(world-1)))
	workers := make([]*Worker, t.NProc)
	for i := range workers {
		rank := t.Nodes.NodeRank*t.NProc + i
		name := fmt.Sprintf("launch-%0*d", width, rank)
		var a []string
		bind, grpcBind := t.Place.Addrs(rank)
		if i < len(t.Binds) && t.Binds[i] != "" {
			bind = t.Binds[i]
		}
		if rank == 0 {
			a = append([]string{"train"}, t.Args...)
			nodes := strconv.Itoa(world)
			if t.MinNodes > 0 {
				nodes = strconv.Itoa(t.MinNodes) + ":" + nodes
			}
			a = append(a, "--nodes", nodes, "--bind", bind, "--node-name", name, "--grpc-bind", grpcBind)
			a = append(a, t.Common...)
		} else {
			a = t.joinArgs(t.Place.Coord, bind, name, grpcBind)
		}
		workers[i] = &Worker{Rank: rank, Name: name, Bind: bind, Cmd: exec.Command(t.Exe, a...)}
		workers[i].Cmd.Env = append(append([]string(nil), t.Env...), LocalRankEnv+"="+strconv.Itoa(i), LaunchedEnv+"=1")
	}
	return workers
}

// Rejoin is the command that restarts w (Elastic.Rejoin): `qvd join peer` with w's node
// name, gossip address and environment, whatever w ran before — the coordinator too, whose
// job goes on without it.
func (t Train) Rejoin(w *Worker, peer string) *exec.Cmd {
	_, grpcBind := t.Place.Addrs(w.Rank)
	cmd := exec.Command(t.Exe, t.joinArgs(peer, w.Bind, w.Name, grpcBind)...)
	cmd.Env = append([]string(nil), w.Cmd.Env...)
	return cmd
}

// joinArgs are the arguments of a worker that joins the job through peer.
func (t Train) joinArgs(peer, bind, name, grpcBind string) []string {
	a := []string{"join", peer, "--bind", bind, "--node-name", name}
	if d, ok := FlagValue(t.Args, "data"); ok && t.Nodes.NNodes > 1 {
		a = append(a, "--data", d) // what a worker on another node takes from the train flags
	}
	a = append(a, "--grpc-bind", grpcBind)
	return append(a, t.Common...)
}

// FlagValue is the value of the flag name in args ("--name V", "--name=V", one dash or two).
func FlagValue(args []string, name string) (string, bool) {
	for i, a := range args {
		if !strings.HasPrefix(a, "-") {
			continue
		}
		n, v, inline := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if n != name {
			continue
		}
		if inline {
			return v, true
		}
		if i+1 < len(args) {
			return args[i+1], true
		}
	}
	return "", false
}

// FreePort finds a port on host that is free for both TCP and UDP (gossip binds both) for
// the coordinator to bind. It picks at random below the kernel's ephemeral range
// (net.ipv4.ip_local_port_range), where no outgoing connection can take it as its local
// port between this check and the coordinator's bind: a port the kernel hands out from
// ":0" is in that range, and a busy machine (a test suite's connections) took one that way.
// Falls back to ":0" where the range cannot be read or nothing below it is free.
func FreePort(host string) (int, error) {
	if lo := ephemeralStart(); lo > 10000 {
		for range 64 {
			p := 10000 + mrand.IntN(lo-10000)
			if portFree(host, p) {
				return p, nil
			}
		}
	}
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err != nil {
		return 0, fmt.Errorf("finding a free port on %s: %w", host, err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// portFree reports whether host:port can be bound for TCP and UDP now.
func portFree(host string, port int) bool {
	addr := net.JoinHostPort(host, strconv.Itoa(port))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return false
	}
	defer l.Close()
	u, err := net.ListenPacket("udp", addr)
	if err != nil {
		return false
	}
	u.Close()
	return true
}

// ephemeralStart is the first port of the kernel's ephemeral range, or 0 if unknown.
func ephemeralStart() int {
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return 0
	}
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return 0
	}
	lo, err := strconv.Atoi(f[0])
	if err != nil {
		return 0
	}
	return lo
}

// ShareCores gives each of n local workers an equal share of the cores, as torchrun sets
// OMP_NUM_THREADS: GOMAXPROCS for the Go runtime (the optimizer's and the collectives'
// goroutines) and OPENBLAS_NUM_THREADS for the matrix products, unless getenv says the user
// set them. Oversubscribed, idle Go processors spin and OpenBLAS threads busy-wait, stealing
// the cores the other workers need: at 4 workers on 2 cores the all-reduce runs ~8% faster
// this way.
func ShareCores(env []string, getenv func(string) string, n int) []string {
	threads := strconv.Itoa(max(1, runtime.NumCPU()/n))
	for _, k := range []string{"GOMAXPROCS", "OPENBLAS_NUM_THREADS"} {
		if getenv(k) == "" {
			env = append(env, k+"="+threads)
		}
	}
	return env
}
