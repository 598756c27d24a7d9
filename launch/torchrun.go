package launch

// torchrun and Kubeflow: a process started by torchrun, by a Kubeflow PyTorchJob or by any
// launcher that follows PyTorch's env:// convention finds its place in the job from RANK,
// WORLD_SIZE, MASTER_ADDR and MASTER_PORT (LOCAL_RANK and LOCAL_WORLD_SIZE optional), so
// `qvd train` runs unchanged where a PyTorch script would.
//
// A process is such a worker when RANK and WORLD_SIZE are set and WORLD_SIZE > 1. Then,
// unless --nodes is given:
//
//   - RANK 0 is the coordinator of a job of WORLD_SIZE processes, its gossip bound at
//     MASTER_ADDR:MASTER_PORT when MASTER_ADDR is an address of this machine, else (a
//     Kubernetes service name, say, or no MASTER_ADDR) at 0.0.0.0:MASTER_PORT;
//   - every other rank runs what `qvd join` runs: it joins MASTER_ADDR:MASTER_PORT, binding
//     the address of this machine that routes to MASTER_ADDR at a free port (gRPC on another
//     free port), so workers sharing a machine never collide; it takes the job's config from
//     the coordinator and ignores its own config flags (except --data);
//   - node names are torchrun-<RANK, zero-padded>: the rendezvous gives the coordinator rank
//     0 and ranks the others by node name, so qvd's rank = RANK, as under SLURM.
//
// MASTER_PORT defaults to 29500 (torchrun's default). LOCAL_WORLD_SIZE > 1 gives each process
// its share of the cores, as qvd launch does, unless GOMAXPROCS or OPENBLAS_NUM_THREADS is set.
// LOCAL_RANK picks the GPU (see localRank). The cluster key is read as everywhere
// (--cluster-key-file, else QVD_CLUSTER_KEY).
//
// These variables win over SLURM's: a launcher that sets RANK per process (torchrun under
// srun) knows the process better than SLURM_PROCID, which numbers the launchers.
//
// Precedence is the one rule of every qvd setting: flags (--nodes turns this detection off;
// --bind and --node-name replace the derived address and name), then the environment, then
// the config file, then the defaults.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

// TorchrunPlan is what one process of a torchrun-style job does.
type TorchrunPlan struct {
	Rank, World           int
	LocalRank, LocalWorld int    // 0 and 0 when unset
	Coordinator           bool   // RANK 0: `qvd train --nodes WORLD_SIZE`
	MasterAddr            string // MASTER_ADDR as given; empty only for rank 0
	Port                  int    // MASTER_PORT: the coordinator's gossip port
	Peer                  string // MASTER_ADDR:MASTER_PORT, for workers to join
	NodeName              string // torchrun-<rank>: sorts by rank, so qvd's rank = RANK
}

// PlanTorchrun maps a process's environment to its role and the coordinator's address. ok is
// false when RANK or WORLD_SIZE is unset or WORLD_SIZE is 1 (then qvd runs as without them).
func PlanTorchrun(getenv func(string) string) (p TorchrunPlan, ok bool, err error) {
	if strings.TrimSpace(getenv("RANK")) == "" || strings.TrimSpace(getenv("WORLD_SIZE")) == "" {
		return p, false, nil
	}
	num := func(name string, lo int) (int, error) { return envInt(getenv, "torchrun environment", name, lo) }
	if p.World, err = num("WORLD_SIZE", 1); err != nil {
		return p, false, err
	}
	if p.Rank, err = num("RANK", 0); err != nil {
		return p, false, err
	}
	if p.Rank >= p.World {
		return p, false, fmt.Errorf("torchrun environment: RANK=%d not below WORLD_SIZE=%d", p.Rank, p.World)
	}
	if p.World == 1 {
		return p, false, nil
	}
	if p.World > 65535 {
		return p, false, fmt.Errorf("torchrun environment: WORLD_SIZE=%d is above 65535", p.World)
	}
	if getenv("LOCAL_WORLD_SIZE") != "" {
		if p.LocalWorld, err = num("LOCAL_WORLD_SIZE", 1); err != nil {
			return p, false, err
		}
	}
	if getenv("LOCAL_RANK") != "" {
		if p.LocalRank, err = num("LOCAL_RANK", 0); err != nil {
			return p, false, err
		}
		if p.LocalWorld > 0 && p.LocalRank >= p.LocalWorld {
			return p, false, fmt.Errorf("torchrun environment: LOCAL_RANK=%d not below LOCAL_WORLD_SIZE=%d", p.LocalRank, p.LocalWorld)
		}
	}
	p.Port = DefaultPort // torchrun's default MASTER_PORT, as under SLURM
	if getenv("MASTER_PORT") != "" {
		if p.Port, err = num("MASTER_PORT", 1); err != nil {
			return p, false, err
		}
		if p.Port > 65534 { // gRPC listens on the next port
			return p, false, fmt.Errorf("torchrun environment: MASTER_PORT=%d: want at most 65534 (gRPC takes the next port)", p.Port)
		}
	}
	p.MasterAddr = strings.TrimSpace(getenv("MASTER_ADDR"))
	p.Coordinator = p.Rank == 0
	if p.MasterAddr == "" && !p.Coordinator {
		return p, false, fmt.Errorf("torchrun environment: RANK=%d of WORLD_SIZE=%d without MASTER_ADDR: a worker needs the coordinator's address", p.Rank, p.World)
	}
	if p.MasterAddr != "" {
		p.Peer = net.JoinHostPort(p.MasterAddr, strconv.Itoa(p.Port))
	}
	p.NodeName = fmt.Sprintf("torchrun-%0*d", len(strconv.Itoa(p.World-1)), p.Rank)
	return p, true, nil
}

// torchrunThreads is a process's share of its machine's cores: ncpu over LOCAL_WORLD_SIZE;
// 0 (the runtime's default) when the user set GOMAXPROCS or OPENBLAS_NUM_THREADS or there is
// no local world. OMP_NUM_THREADS, which torchrun sets to 1 as a precaution, is not ours.
func torchrunThreads(getenv func(string) string, localWorld, ncpu int) int {
	if getenv("GOMAXPROCS") != "" || getenv("OPENBLAS_NUM_THREADS") != "" || localWorld < 1 {
		return 0
	}
	return max(1, ncpu/localWorld)
}

// torchrunBind is the gossip address a process of the plan binds. The coordinator binds
// MASTER_ADDR's IP when it is this machine's, else the wildcard; a worker binds, at a free
// port, the local address its route to MASTER_ADDR leaves from (no packet is sent).
func torchrunBind(ctx context.Context, p TorchrunPlan) (string, error) {
	port := strconv.Itoa(p.Port)
	if p.MasterAddr == "" {
		return net.JoinHostPort("0.0.0.0", port), nil
	}
	if p.Coordinator {
		b, err := coordinatorBind(ctx, p.MasterAddr, p.Port)
		if err != nil {
			return "", fmt.Errorf("MASTER_ADDR: %w", err)
		}
		return b, nil
	}
	ip, err := resolveHost(ctx, p.MasterAddr)
	if err != nil {
		return "", fmt.Errorf("MASTER_ADDR: %w", err)
	}
	local, err := routeFrom(ctx, ip, p.Port)
	if err != nil {
		return "", fmt.Errorf("MASTER_ADDR %s: %w", p.MasterAddr, err)
	}
	return net.JoinHostPort(local, "0"), nil
}

// routeFrom is this machine's address that traffic to ip:port leaves from: the one to bind
// so the coordinator can reach back. A UDP "connection" only consults the routing table; no
// packet is sent.
func routeFrom(ctx context.Context, ip string, port int) (string, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.DialContext(ctx, "udp", net.JoinHostPort(ip, strconv.Itoa(port)))
	if err != nil {
		return "", fmt.Errorf("no route: %w", err)
	}
	defer c.Close()
	local, ok := c.LocalAddr().(*net.UDPAddr)
	if !ok {
		return "", errors.New("no local address routes there")
	}
	return local.IP.String(), nil
}

// coordinatorBind is the gossip address for a coordinator reached at host:port: host's IP
// when it is this machine's, else the wildcard (host is then a name that routes here from
// outside, such as a Kubernetes service).
func coordinatorBind(ctx context.Context, host string, port int) (string, error) {
	ip, err := resolveHost(ctx, host)
	if err != nil {
		return "", err
	}
	if isLocalIP(net.ParseIP(ip)) {
		return net.JoinHostPort(ip, strconv.Itoa(port)), nil
	}
	return net.JoinHostPort("0.0.0.0", strconv.Itoa(port)), nil
}

// isLocalIP reports whether ip is one of this machine's addresses (loopback included).
func isLocalIP(ip net.IP) bool {
	if ip == nil {
		return false
	}
	if ip.IsLoopback() {
		return true
	}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return false
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.Equal(ip) {
			return true
		}
	}
	return false
}
