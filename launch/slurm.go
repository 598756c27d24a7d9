package launch

// SLURM: `srun qvd train -c CONFIG` starts one qvd per task, and each task finds its place in
// the job from the variables srun sets, as torchrun and PyTorch Lightning do, so a batch
// script needs no logic to turn them into flags (scripts/slurm/qvd.sbatch).
//
// A process is a SLURM task when SLURM_STEP_ID (or SLURM_STEPID) is set — srun sets it; the
// batch script itself has SLURM_PROCID and SLURM_NTASKS but no step — and SLURM_NTASKS > 1.
// Then, unless --nodes is given:
//
//   - task 0 (SLURM_PROCID=0) is the coordinator of a job of SLURM_NTASKS processes, bound to
//     the first host of the step's node list (SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST,
//     else SLURM_NODELIST) at the base port;
//   - every other task runs what `qvd join` runs: it joins that address and binds its own host
//     (SLURMD_NODENAME, else the hostname) at base port + 3·SLURM_LOCALID (gossip; gRPC on the
//     next port; the third is spare), takes the job's config from the coordinator and ignores
//     its own config flags (except --data, which overrides data.path on its machine);
//   - node names are slurm-<SLURM_JOB_ID>-<SLURM_PROCID, zero-padded>: the rendezvous ranks
//     workers by node name, so rank = SLURM_PROCID.
//
// The base port is $QVD_PORT, else $MASTER_PORT, else 29500 (torchrun's default); $MASTER_ADDR,
// if set, replaces the first host as the coordinator's address (as in Lightning).
//
// Precedence, highest first: flags given on the command line (--nodes turns SLURM detection
// off; --bind and --node-name replace this task's derived address and name), then the
// environment (SLURM_*, QVD_PORT, MASTER_ADDR, MASTER_PORT, QVD_CLUSTER_KEY), then the config
// file, then the built-in defaults.
//
// The pure part — hostlist expansion and the environment → plan mapping — is in functions
// tests drive directly; name resolution and the process's environment are read at the edge.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

const (
	// slurmPortStride is the ports each task on a node reserves from the base: gossip, gRPC
	// (gossip+1) and one spare.
	slurmPortStride = 3
	// maxHostlist bounds a node list's expansion, so a typo like "n[0-999999999]" is an
	// error, not an allocation of gigabytes.
	maxHostlist = 1 << 16
)

// ErrHostlist: a SLURM node list that does not parse.
var ErrHostlist = errors.New("invalid SLURM hostlist")

// SlurmPlan is what one SLURM task does.
type SlurmPlan struct {
	ProcID, NTasks, LocalID int
	Coordinator             bool   // task 0: `qvd train --nodes NTasks`
	BindHost                string // host (name or IP) this task binds; resolved at the edge
	BindPort                int    // gossip port; gRPC on BindPort+1
	Peer                    string // host:port of the coordinator's gossip, for workers to join
	NodeName                string // slurm-<job>-<procid>: sorts by procid, so rank = procid
	Devices                 int    // GPUs this task sees (CUDA_VISIBLE_DEVICES, else SLURM_GPUS_ON_NODE)
}

// envInt reads the launcher's (what's) integer variable name, at least lo.
func envInt(getenv func(string) string, what, name string, lo int) (int, error) {
	v, err := strconv.Atoi(strings.TrimSpace(getenv(name)))
	if err != nil || v < lo {
		return 0, fmt.Errorf("%s: %s=%q: want an integer ≥ %d", what, name, getenv(name), lo)
	}
	return v, nil
}

// PlanSlurm maps a task's environment to its role and addresses. hostname is this machine's
// name, used when SLURMD_NODENAME is unset. ok is false when this is not a multi-task SLURM
// step (then qvd runs as it would without SLURM).
func PlanSlurm(getenv func(string) string, hostname string) (p SlurmPlan, ok bool, err error) {
	if getenv("SLURM_STEP_ID") == "" && getenv("SLURM_STEPID") == "" {
		return p, false, nil
	}
	if getenv("SLURM_PROCID") == "" || getenv("SLURM_NTASKS") == "" {
		return p, false, nil
	}
	num := func(name string, lo int) (int, error) { return envInt(getenv, "SLURM", name, lo) }
	if p.NTasks, err = num("SLURM_NTASKS", 1); err != nil {
		return p, false, err
	}
	if p.NTasks == 1 {
		return p, false, nil
	}
	if p.ProcID, err = num("SLURM_PROCID", 0); err != nil {
		return p, false, err
	}
	if p.ProcID >= p.NTasks {
		return p, false, fmt.Errorf("SLURM: SLURM_PROCID=%d not below SLURM_NTASKS=%d", p.ProcID, p.NTasks)
	}
	if getenv("SLURM_LOCALID") != "" {
		if p.LocalID, err = num("SLURM_LOCALID", 0); err != nil {
			return p, false, err
		}
	}
	base := DefaultPort
	for _, name := range []string{"QVD_PORT", "MASTER_PORT"} {
		if getenv(name) != "" {
			if base, err = num(name, 1); err != nil {
				return p, false, err
			}
			break
		}
	}
	if last := base + slurmPortStride*p.LocalID + 1; last > 65535 {
		return p, false, fmt.Errorf("SLURM: base port %d + %d·SLURM_LOCALID (%d) + 1 = %d is above 65535", base, slurmPortStride, p.LocalID, last)
	}

	coordHost := getenv("MASTER_ADDR")
	if coordHost == "" {
		list, from := "", ""
		for _, name := range []string{"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"} {
			if list = getenv(name); list != "" {
				from = name
				break
			}
		}
		if list == "" {
			return p, false, errors.New("SLURM: no node list (SLURM_STEP_NODELIST, SLURM_JOB_NODELIST, SLURM_NODELIST) and no MASTER_ADDR")
		}
		hosts, err := expandHostlist(list)
		if err != nil {
			return p, false, fmt.Errorf("SLURM: %s: %w", from, err)
		}
		coordHost = hosts[0]
	}
	self := getenv("SLURMD_NODENAME")
	if self == "" {
		self = hostname
	}

	p.Devices = slurmDevices(getenv("CUDA_VISIBLE_DEVICES"), getenv("SLURM_GPUS_ON_NODE"))
	job := getenv("SLURM_JOB_ID")
	if job == "" {
		job = getenv("SLURM_JOBID")
	}
	width := len(strconv.Itoa(p.NTasks - 1))
	if job != "" {
		p.NodeName = fmt.Sprintf("slurm-%s-%0*d", job, width, p.ProcID)
	} else {
		p.NodeName = fmt.Sprintf("slurm-%0*d", width, p.ProcID)
	}
	p.Peer = net.JoinHostPort(coordHost, strconv.Itoa(base))
	if p.ProcID == 0 {
		// With block or cyclic distribution task 0 runs on the first node; with an arbitrary
		// one it may not, and binding the first node's address would fail obscurely.
		if getenv("MASTER_ADDR") == "" && getenv("SLURMD_NODENAME") != "" && self != coordHost {
			return p, false, fmt.Errorf("SLURM: task 0 runs on %s, not on the first host of the node list (%s); set MASTER_ADDR to this host", self, coordHost)
		}
		p.Coordinator, p.BindHost, p.BindPort = true, coordHost, base
		return p, true, nil
	}
	p.BindHost, p.BindPort = self, base+slurmPortStride*p.LocalID
	return p, true, nil
}

// slurmDevices counts the GPUs a task sees: the entries of CUDA_VISIBLE_DEVICES when set
// (SLURM sets it to the task's GPUs, "NoDevFiles" when it has none), else SLURM_GPUS_ON_NODE.
func slurmDevices(visible, onNode string) int {
	if v := strings.TrimSpace(visible); v != "" {
		if v == "NoDevFiles" || v == "-1" {
			return 0
		}
		n := 0
		for _, d := range strings.Split(v, ",") {
			if strings.TrimSpace(d) != "" {
				n++
			}
		}
		return n
	}
	if n, err := strconv.Atoi(strings.TrimSpace(onNode)); err == nil && n > 0 {
		return n
	}
	return 0
}

// expandHostlist expands a SLURM hostlist expression as `scontrol show hostnames` does:
// "node[01-03,07],gpu-a[1-2],login" is node01 node02 node03 node07 gpu-a1 gpu-a2 login.
// A range keeps the zero padding of its lower bound ("[08-10]": 08 09 10); a name with
// several bracket groups expands to their product ("r[1-2]n[1-2]": r1n1 r1n2 r2n1 r2n2).
func expandHostlist(list string) ([]string, error) {
	var hosts []string
	depth, start := 0, 0
	for i := 0; i <= len(list); i++ {
		if i < len(list) {
			switch list[i] {
			case '[':
				depth++
				if depth > 1 {
					return nil, fmt.Errorf("%w: %q: nested '['", ErrHostlist, list)
				}
				continue
			case ']':
				depth--
				if depth < 0 {
					return nil, fmt.Errorf("%w: %q: ']' without '['", ErrHostlist, list)
				}
				continue
			case ',':
				if depth > 0 {
					continue
				}
			default:
				continue
			}
		} else if depth != 0 {
			return nil, fmt.Errorf("%w: %q: '[' without ']'", ErrHostlist, list)
		}
		item := strings.TrimSpace(list[start:i])
		start = i + 1
		if item == "" {
			continue
		}
		var err error
		if hosts, err = expandHost(hosts, item); err != nil {
			return nil, fmt.Errorf("%w: %q: %w", ErrHostlist, list, err)
		}
	}
	if len(hosts) == 0 {
		return nil, fmt.Errorf("%w: %q: no hosts", ErrHostlist, list)
	}
	return hosts, nil
}

// expandHost appends the names one hostlist item ("node[01-03,07]") stands for to out.
func expandHost(out []string, item string) ([]string, error) {
	open := strings.IndexByte(item, '[')
	if open < 0 {
		if strings.ContainsRune(item, ']') {
			return nil, fmt.Errorf("']' without '[' in %q", item)
		}
		return append(out, item), nil
	}
	end := strings.IndexByte(item[open:], ']')
	if end < 0 {
		return nil, fmt.Errorf("'[' without ']' in %q", item)
	}
	end += open
	prefix, body, rest := item[:open], item[open+1:end], item[end+1:]
	suffixes, err := expandHost(nil, rest) // [""] when nothing follows the brackets
	if err != nil {
		return nil, err
	}
	for _, part := range strings.Split(body, ",") {
		lo, hi, isRange := strings.Cut(strings.TrimSpace(part), "-")
		if !isRange {
			hi = lo
		}
		a, err1 := strconv.ParseUint(lo, 10, 32)
		b, err2 := strconv.ParseUint(hi, 10, 32)
		if err1 != nil || err2 != nil {
			return nil, fmt.Errorf("%q in %q is not a number or range", part, item)
		}
		if b < a {
			return nil, fmt.Errorf("range %q in %q runs backwards", part, item)
		}
		if uint64(len(out))+(b-a+1)*uint64(len(suffixes)) > maxHostlist {
			return nil, fmt.Errorf("more than %d hosts", maxHostlist)
		}
		for v := a; v <= b; v++ {
			name := fmt.Sprintf("%s%0*d", prefix, len(lo), v)
			for _, s := range suffixes {
				out = append(out, name+s)
			}
		}
	}
	return out, nil
}

// resolveHost returns host itself when it is an IP address, else its first IPv4 address
// (or first address) from the resolver: the cluster binds IP literals.
func resolveHost(ctx context.Context, host string) (string, error) {
	if ip := net.ParseIP(host); ip != nil {
		return host, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	addrs, err := net.DefaultResolver.LookupIPAddr(ctx, host)
	if err != nil {
		return "", fmt.Errorf("resolving %s: %w", host, err)
	}
	for _, a := range addrs {
		if a.IP.To4() != nil {
			return a.IP.String(), nil
		}
	}
	if len(addrs) == 0 {
		return "", fmt.Errorf("resolving %s: no addresses", host)
	}
	return addrs[0].IP.String(), nil
}

// slurmThreads is a task's share of its node's cores: SLURM_CPUS_PER_TASK when set, else the
// node's cores over its tasks (SLURM_NTASKS_PER_NODE, or the first count of
// SLURM_TASKS_PER_NODE such as "2(x3)"); 0 when GOMAXPROCS or OPENBLAS_NUM_THREADS is set (the
// user chose) or nothing says.
func slurmThreads(getenv func(string) string, ncpu int) int {
	if getenv("GOMAXPROCS") != "" || getenv("OPENBLAS_NUM_THREADS") != "" {
		return 0
	}
	if n, err := strconv.Atoi(strings.TrimSpace(getenv("SLURM_CPUS_PER_TASK"))); err == nil && n > 0 {
		return n
	}
	per := strings.TrimSpace(getenv("SLURM_NTASKS_PER_NODE"))
	if per == "" {
		per = strings.TrimSpace(getenv("SLURM_TASKS_PER_NODE"))
		if i := strings.IndexAny(per, "(,"); i >= 0 {
			per = per[:i]
		}
	}
	if n, err := strconv.Atoi(per); err == nil && n > 0 {
		return max(1, ncpu/n)
	}
	return 0
}
