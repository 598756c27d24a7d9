package launch

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"
)

func TestHostlist(t *testing.T) {
	for _, c := range []struct {
		in   string
		want string // space-separated
	}{
		{"vm", "vm"},
		{"host1,host2", "host1 host2"},
		{"node[01-04,07],gpu-a[1-2]", "node01 node02 node03 node04 node07 gpu-a1 gpu-a2"},
		{"node[08-10]", "node08 node09 node10"},
		{"node[8-10]", "node8 node9 node10"},
		{"n[098-101]", "n098 n099 n100 n101"},
		{"n[0-2]x", "n0x n1x n2x"},
		{"r[1-2]n[1-2]", "r1n1 r1n2 r2n1 r2n2"},
		{"a[3],b", "a3 b"},
		{"c1-[1-2],login", "c1-1 c1-2 login"},
		{"10.0.0.1,10.0.0.2", "10.0.0.1 10.0.0.2"},
		{" x , y ,", "x y"},
	} {
		got, err := expandHostlist(c.in)
		if err != nil {
			t.Errorf("%q: %v", c.in, err)
			continue
		}
		if strings.Join(got, " ") != c.want {
			t.Errorf("%q: got %q, want %q", c.in, strings.Join(got, " "), c.want)
		}
	}
	for _, bad := range []string{"", ",", "node[1-", "node]1[", "node[a-b]", "node[3-1]", "node[1-2", "n[[1]]", "n[]", "n[-2]", "n[1-2]]", "n[0-99999999]"} {
		if got, err := expandHostlist(bad); !errors.Is(err, ErrHostlist) {
			t.Errorf("%q: got %v, %v; want ErrHostlist", bad, got, err)
		}
	}
}

// slurmEnv is a step's environment as srun sets it (checked against slurm-wlm 22.05), for task
// procid of ntasks with localid.
func slurmEnv(procid, ntasks, localid int, extra ...string) func(string) string {
	env := map[string]string{
		"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "417", "SLURM_PROCID": fmt.Sprint(procid),
		"SLURM_NTASKS": fmt.Sprint(ntasks), "SLURM_LOCALID": fmt.Sprint(localid),
		"SLURM_JOB_NODELIST": "node[07-08]", "SLURM_STEP_NODELIST": "node[07-08]", "SLURMD_NODENAME": "node07",
	}
	for i := 0; i+1 < len(extra); i += 2 {
		env[extra[i]] = extra[i+1]
	}
	return func(k string) string { return env[k] }
}

func TestSlurmPlan(t *testing.T) {
	for _, c := range []struct {
		name   string
		getenv func(string) string
		ok     bool
		want   SlurmPlan // Devices, LocalID and NTasks compared too
	}{
		{"not slurm", func(string) string { return "" }, false, SlurmPlan{}},
		{"batch script (no step)", slurmEnv(0, 4, 0, "SLURM_STEP_ID", ""), false, SlurmPlan{}},
		{"one task", slurmEnv(0, 1, 0), false, SlurmPlan{}},
		{"task 0", slurmEnv(0, 4, 0), true, SlurmPlan{ProcID: 0, NTasks: 4, Coordinator: true, BindHost: "node07", BindPort: 29500,
			Peer: "node07:29500", NodeName: "slurm-417-0"}},
		{"task 1 same node", slurmEnv(1, 4, 1), true, SlurmPlan{ProcID: 1, NTasks: 4, LocalID: 1, BindHost: "node07", BindPort: 29503,
			Peer: "node07:29500", NodeName: "slurm-417-1"}},
		{"task 2 second node", slurmEnv(2, 4, 0, "SLURMD_NODENAME", "node08"), true, SlurmPlan{ProcID: 2, NTasks: 4, BindHost: "node08", BindPort: 29500,
			Peer: "node07:29500", NodeName: "slurm-417-2"}},
		{"QVD_PORT over MASTER_PORT", slurmEnv(3, 12, 1, "QVD_PORT", "40000", "MASTER_PORT", "12910", "SLURMD_NODENAME", "node08"), true,
			SlurmPlan{ProcID: 3, NTasks: 12, LocalID: 1, BindHost: "node08", BindPort: 40003, Peer: "node07:40000", NodeName: "slurm-417-03"}},
		{"MASTER_ADDR and MASTER_PORT", slurmEnv(0, 2, 0, "MASTER_ADDR", "10.1.2.3", "MASTER_PORT", "12910"), true,
			SlurmPlan{NTasks: 2, Coordinator: true, BindHost: "10.1.2.3", BindPort: 12910, Peer: "10.1.2.3:12910", NodeName: "slurm-417-0"}},
		{"step node list first", slurmEnv(1, 2, 0, "SLURM_STEP_NODELIST", "gpu[3-4]", "SLURMD_NODENAME", "gpu4"), true,
			SlurmPlan{ProcID: 1, NTasks: 2, BindHost: "gpu4", BindPort: 29500, Peer: "gpu3:29500", NodeName: "slurm-417-1"}},
		{"job node list, no SLURMD_NODENAME", slurmEnv(1, 2, 1, "SLURM_STEP_NODELIST", "", "SLURMD_NODENAME", ""), true,
			SlurmPlan{ProcID: 1, NTasks: 2, LocalID: 1, BindHost: "thishost", BindPort: 29503, Peer: "node07:29500", NodeName: "slurm-417-1"}},
		{"old SLURM_STEPID, SLURM_JOBID, SLURM_NODELIST", slurmEnv(1, 2, 0, "SLURM_STEP_ID", "", "SLURM_STEPID", "0", "SLURM_JOB_ID", "",
			"SLURM_JOBID", "9", "SLURM_STEP_NODELIST", "", "SLURM_JOB_NODELIST", "", "SLURM_NODELIST", "a,b", "SLURMD_NODENAME", "b"), true,
			SlurmPlan{ProcID: 1, NTasks: 2, BindHost: "b", BindPort: 29500, Peer: "a:29500", NodeName: "slurm-9-1"}},
		{"GPUs from CUDA_VISIBLE_DEVICES", slurmEnv(0, 2, 0, "CUDA_VISIBLE_DEVICES", "2,3", "SLURM_GPUS_ON_NODE", "4"), true,
			SlurmPlan{NTasks: 2, Coordinator: true, BindHost: "node07", BindPort: 29500, Peer: "node07:29500", NodeName: "slurm-417-0", Devices: 2}},
		{"GPUs from SLURM_GPUS_ON_NODE", slurmEnv(0, 2, 0, "SLURM_GPUS_ON_NODE", "4"), true,
			SlurmPlan{NTasks: 2, Coordinator: true, BindHost: "node07", BindPort: 29500, Peer: "node07:29500", NodeName: "slurm-417-0", Devices: 4}},
		{"no GPU files", slurmEnv(0, 2, 0, "CUDA_VISIBLE_DEVICES", "NoDevFiles", "SLURM_GPUS_ON_NODE", "4"), true,
			SlurmPlan{NTasks: 2, Coordinator: true, BindHost: "node07", BindPort: 29500, Peer: "node07:29500", NodeName: "slurm-417-0"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, ok, err := PlanSlurm(c.getenv, "thishost")
			if err != nil {
				t.Fatal(err)
			}
			if ok != c.ok {
				t.Fatalf("ok = %v, want %v", ok, c.ok)
			}
			if ok && got != c.want {
				t.Fatalf("got  %+v\nwant %+v", got, c.want)
			}
		})
	}
}

func TestSlurmPlanErrors(t *testing.T) {
	for _, c := range []struct {
		name   string
		getenv func(string) string
		want   string
	}{
		{"procid not a number", slurmEnv(0, 2, 0, "SLURM_PROCID", "x"), "SLURM_PROCID"},
		{"procid too large", slurmEnv(2, 2, 0), "not below"},
		{"bad ntasks", slurmEnv(0, 0, 0), "SLURM_NTASKS"},
		{"bad port", slurmEnv(0, 2, 0, "QVD_PORT", "http"), "QVD_PORT"},
		{"port overflow", slurmEnv(1, 2, 1, "QVD_PORT", "65533"), "above 65535"},
		{"bad node list", slurmEnv(1, 2, 1, "SLURM_STEP_NODELIST", "n[1-"), "SLURM_STEP_NODELIST"},
		{"no node list", slurmEnv(1, 2, 1, "SLURM_STEP_NODELIST", "", "SLURM_JOB_NODELIST", ""), "no node list"},
		{"task 0 not on the first node", slurmEnv(0, 2, 0, "SLURMD_NODENAME", "node08"), "MASTER_ADDR"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, _, err := PlanSlurm(c.getenv, "thishost")
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want an error mentioning %q", err, c.want)
			}
		})
	}
}

// TestSlurmRankOrder: the rendezvous ranks workers by node name, so the names of a step's
// tasks must sort in SLURM_PROCID order for every width of the task count.
func TestSlurmRankOrder(t *testing.T) {
	for _, n := range []int{2, 10, 11, 101, 1000} {
		var names []string
		for i := range n {
			p, ok, err := PlanSlurm(slurmEnv(i, n, i%4, "SLURMD_NODENAME", "node07"), "")
			if err != nil || !ok {
				t.Fatalf("task %d of %d: %v %v", i, n, ok, err)
			}
			names = append(names, p.NodeName)
		}
		if !sort.StringsAreSorted(names) || len(slices.Compact(slices.Clone(names))) != n {
			t.Fatalf("%d tasks: node names not unique and in procid order: %v", n, names)
		}
	}
}

func TestSlurmThreads(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		want int
	}{
		{map[string]string{}, 0},
		{map[string]string{"SLURM_CPUS_PER_TASK": "3", "SLURM_TASKS_PER_NODE": "2"}, 3},
		{map[string]string{"SLURM_TASKS_PER_NODE": "4(x2),1"}, 4},
		{map[string]string{"SLURM_NTASKS_PER_NODE": "2"}, 8},
		{map[string]string{"SLURM_TASKS_PER_NODE": "32"}, 1},
		{map[string]string{"SLURM_TASKS_PER_NODE": "2", "OPENBLAS_NUM_THREADS": "5"}, 0},
	} {
		if got := slurmThreads(func(k string) string { return c.env[k] }, 16); got != c.want {
			t.Errorf("%v: %d threads, want %d", c.env, got, c.want)
		}
	}
}
