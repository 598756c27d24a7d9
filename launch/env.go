package launch

import (
	"context"
	"fmt"
	"net"
	"strconv"

	"go.uber.org/zap"
)

// Env is what FromEnv reads: the process's environment and machine, and the flags that win
// over what the environment implies.
type Env struct {
	Getenv   func(string) string
	Hostname string // this machine's name, used when SLURMD_NODENAME is unset
	NumCPU   int
	// Bind and NodeName were given on the command line (BindSet, NodeNameSet): they replace
	// the derived gossip address and node name.
	Bind, NodeName       string
	BindSet, NodeNameSet bool
}

// Task is a process's place in a job that a launcher's environment describes.
type Task struct {
	Coordinator bool   // `qvd train --nodes World`; else a `qvd join` worker of Peer
	World       int    // processes in the job
	Bind        string // gossip address this process binds
	NodeName    string // sorts in rank order, so qvd's rank is the launcher's
	Peer        string // the coordinator's gossip address
	// Threads is this process's share of its machine's cores, for GOMAXPROCS and the BLAS
	// threads; 0 leaves them (the user set them, or nothing says).
	Threads int

	torchrun *TorchrunPlan
	slurm    *SlurmPlan
}

// FromEnv maps a process's environment to its task: torchrun's variables (RANK, WORLD_SIZE,
// MASTER_ADDR, ...), else a SLURM step's. ok is false outside such a job (then nothing
// applies). Its errors name the variable or address at fault; the caller treats them as
// usage errors.
func FromEnv(ctx context.Context, e Env) (t Task, ok bool, err error) {
	tp, ok, err := PlanTorchrun(e.Getenv)
	if err != nil || ok {
		if err != nil {
			return t, false, err
		}
		t = Task{Coordinator: tp.Coordinator, World: tp.World, NodeName: tp.NodeName, Peer: tp.Peer, torchrun: &tp}
		if t.Bind = e.Bind; !e.BindSet {
			if t.Bind, err = torchrunBind(ctx, tp); err != nil {
				return t, false, fmt.Errorf("RANK %d: %v (or set --bind)", tp.Rank, err)
			}
		}
		t.Threads = torchrunThreads(e.Getenv, tp.LocalWorld, e.NumCPU)
		return t.named(e), true, nil
	}
	sp, ok, err := PlanSlurm(e.Getenv, e.Hostname)
	if err != nil || !ok {
		return t, false, err
	}
	t = Task{Coordinator: sp.Coordinator, World: sp.NTasks, NodeName: sp.NodeName, Peer: sp.Peer, slurm: &sp}
	if t.Bind = e.Bind; !e.BindSet {
		ip, err := resolveHost(ctx, sp.BindHost)
		if err != nil {
			return t, false, fmt.Errorf("SLURM task %d: %v (set --bind, or MASTER_ADDR for task 0)", sp.ProcID, err)
		}
		t.Bind = net.JoinHostPort(ip, strconv.Itoa(sp.BindPort))
	}
	t.Threads = slurmThreads(e.Getenv, e.NumCPU)
	return t.named(e), true, nil
}

func (t Task) named(e Env) Task {
	if e.NodeNameSet {
		t.NodeName = e.NodeName
	}
	return t
}

// Log writes what the task is, as the process starts: its share of the cores and its place.
func (t Task) Log(log *zap.Logger) {
	role := "worker"
	if t.Coordinator {
		role = "coordinator"
	}
	if p := t.torchrun; p != nil {
		if t.Threads > 0 {
			log.Info("torchrun process threads", zap.Int("threads", t.Threads))
		}
		log.Info("torchrun environment", zap.Int("rank", p.Rank), zap.Int("world_size", p.World),
			zap.Int("local_rank", p.LocalRank), zap.Int("local_world_size", p.LocalWorld), zap.String("role", role),
			zap.String("bind", t.Bind), zap.String("coordinator", t.Peer), zap.String("node_name", t.NodeName))
		return
	}
	p := t.slurm
	if t.Threads > 0 {
		// As qvd launch does for its workers: tasks sharing a node share its cores, or idle Go
		// processors spin and OpenBLAS threads busy-wait on each other's cores. The same share
		// also gives the same matrix-product summation order as qvd launch.
		log.Info("SLURM task threads", zap.Int("threads", t.Threads))
	}
	log.Info("SLURM task", zap.Int("procid", p.ProcID), zap.Int("ntasks", p.NTasks), zap.Int("localid", p.LocalID),
		zap.String("role", role), zap.String("bind", t.Bind), zap.String("coordinator", p.Peer),
		zap.String("node_name", t.NodeName), zap.Int("gpus", p.Devices))
}
