package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/job"
)

// netnsPair makes two network namespaces joined by a veth pair, 10.213.X.1 and 10.213.X.2,
// removed at cleanup: two "machines" that reach each other only over that link. ok is false
// (and the test says why) where that takes privileges this run lacks.
func netnsPair(t *testing.T) (nsA, nsB, ipA, ipB string, ok bool) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Log("not root: no network namespaces")
		return "", "", "", "", false
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Log("no ip(8): no network namespaces")
		return "", "", "", "", false
	}
	id := os.Getpid() % 250
	nsA, nsB = fmt.Sprintf("qvd-test-a%d", os.Getpid()), fmt.Sprintf("qvd-test-b%d", os.Getpid())
	vA, vB := fmt.Sprintf("qva%d", os.Getpid()), fmt.Sprintf("qvb%d", os.Getpid())
	ipA, ipB = fmt.Sprintf("10.213.%d.1", id), fmt.Sprintf("10.213.%d.2", id)
	ipc := func(args ...string) error {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
		return nil
	}
	for _, ns := range []string{nsA, nsB} {
		if err := ipc("netns", "add", ns); err != nil {
			t.Logf("no network namespaces: %v", err)
			return "", "", "", "", false
		}
		t.Cleanup(func() { _ = ipc("netns", "del", ns) }) // removes the veth end inside too
	}
	for _, step := range [][]string{
		{"link", "add", vA, "type", "veth", "peer", "name", vB},
		{"link", "set", vA, "netns", nsA}, {"link", "set", vB, "netns", nsB},
		{"-n", nsA, "addr", "add", ipA + "/24", "dev", vA}, {"-n", nsB, "addr", "add", ipB + "/24", "dev", vB},
		{"-n", nsA, "link", "set", "lo", "up"}, {"-n", nsB, "link", "set", "lo", "up"},
		{"-n", nsA, "link", "set", vA, "up"}, {"-n", nsB, "link", "set", vB, "up"},
	} {
		if err := ipc(step...); err != nil {
			t.Logf("setting up the namespaces: %v", err)
			return "", "", "", "", false
		}
	}
	return nsA, nsB, ipA, ipB, true
}

// TestLaunchNodes (ecosystem item 4): two `qvd launch --nnodes 2 --node-rank R --nproc 2
// --master-addr A --master-port P`, one per network namespace (two machines joined by one
// link; on loopback where namespaces are not available), run one job of four ranks: node 1's
// workers are ranks 2 and 3, every rank ends with the same weights, and those are one process's
// with the same global batch.
func TestLaunchNodes(t *testing.T) {
	needDataset(t)
	if testing.Short() {
		t.Skip("multi-process")
	}
	launchNodes(t, "tcp", false)
}

// TestLaunchNodesHierarchical (issue 19): the same job with collective.transport auto, each
// launcher also in an IPC namespace and /dev/shm of its own, as two machines are. auto must
// choose the hierarchical data plane on every rank (shared memory within a node, TCP across),
// and the four ranks must end identical and within float tolerance of one process.
func TestLaunchNodesHierarchical(t *testing.T) {
	needDataset(t)
	if testing.Short() {
		t.Skip("multi-process")
	}
	if _, err := exec.LookPath("unshare"); err != nil {
		t.Skip("no unshare(1)")
	}
	launchNodes(t, "auto", true)
}

// launchNodes runs the two-launcher job with --transport transport; privateShm puts each
// launcher in its own IPC namespace with a fresh /dev/shm (network namespaces are then
// required).
func launchNodes(t *testing.T, transport string, privateShm bool) {
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	nsA, nsB, ipA, _, netns := netnsPair(t)
	if privateShm && !netns {
		t.Skip("separate IPC namespaces need network namespaces here")
	}
	master, port := "127.0.0.1", freePortPair(t)
	if netns {
		master, port = ipA, 29500 // namespaces are fresh: torchrun's default port is free
	} else {
		t.Log("two launchers on loopback, not in two network namespaces")
	}
	dir := t.TempDir()
	out := filepath.Join(dir, "nodes")
	small := []string{"--train-subset", "1024", "--test-subset", "200", "--max-steps", "8", "--transport", transport, "--seed", "5", "--quiet"}
	var outs []*syncBuffer
	var dones []<-chan int
	for node, ns := range []string{nsA, nsB} {
		args := append([]string{"launch", "--nnodes", "2", "--node-rank", fmt.Sprint(node), "--nproc", "2", "--master-addr", master,
			"--master-port", fmt.Sprint(port), "--out", out, "--micro-batch", "8"}, small...)
		var cmd *exec.Cmd
		switch {
		case privateShm:
			// unshare's mount namespace keeps the new tmpfs to this launcher's processes.
			sh := []string{"netns", "exec", ns, "unshare", "--ipc", "--mount", "--", "sh", "-c",
				`mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$0" "$@"`, exe}
			cmd = exec.Command("ip", append(sh, args...)...)
		case netns:
			cmd = exec.Command("ip", append([]string{"netns", "exec", ns, exe}, args...)...)
		default:
			cmd = exec.Command(exe, args...)
		}
		cmd.Env = append(launcherEnv(), asQVD+"=1", job.ClusterKeyEnv+"="+testKey)
		o := &syncBuffer{}
		cmd.Stdout, cmd.Stderr = o, o
		outs, dones = append(outs, o), append(dones, started(t, cmd))
	}
	sums := map[string]bool{}
	for node, done := range dones {
		select {
		case code := <-done:
			if code != exitOK {
				t.Fatalf("node %d: exit %d\n%s\n--- other node:\n%s", node, code, outs[node], tail(outs[1-node].String(), 30))
			}
		case <-time.After(3 * time.Minute):
			t.Fatalf("the job did not finish:\n%s\n%s", outs[0], outs[1])
		}
		for _, m := range weightsRE.FindAllStringSubmatch(outs[node].String(), -1) {
			sums[m[1]] = true
		}
	}
	n1 := outs[1].String()
	for _, r := range []int{2, 3} {
		if !strings.Contains(n1, fmt.Sprintf(`[rank %d]`, r)) || !strings.Contains(n1, fmt.Sprintf(`"rank": %d`, r)) {
			t.Fatalf("node 1 did not run rank %d:\n%s", r, n1)
		}
	}
	if want := map[string]string{"tcp": "tcp", "auto": "hierarchical"}[transport]; strings.Count(outs[0].String()+n1, `"data_plane": "`+want+`"`) != 4 {
		t.Fatalf("want the %s data plane on all four ranks:\n%s\n%s", want, outs[0], n1)
	}
	if len(sums) != 1 || strings.Count(outs[0].String()+n1, "weights_sha256") < 4 {
		t.Fatalf("want one weights_sha256 from all four ranks, got %v:\n%s\n%s", sums, outs[0], n1)
	}
	single := filepath.Join(dir, "single")
	if code, so, se := runQVD(t, append([]string{"train", "--out", single, "--micro-batch", "32"}, small...)...); code != exitOK {
		t.Fatalf("single process: exit %d\n%s\n%s", code, so, se)
	}
	if d := maxDiff(t, readModel(t, filepath.Join(single, "checkpoints")), readModel(t, filepath.Join(out, "checkpoints"))); d > 1e-5 {
		t.Fatalf("2 nodes × 2 processes end %g away from one process with the same global batch", d)
	} else {
		t.Logf("2 launchers (netns %v, transport %s) × 2 processes vs 1 process, global batch 32: max weight difference %.3g", netns, transport, d)
	}
}

func TestLaunchNodesFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--nnodes", "2", "--node-rank", "0"}, "--master-addr"},
		{[]string{"--nnodes", "2", "--node-rank", "2", "--master-addr", "h"}, "--node-rank"},
		{[]string{"--nnodes", "0"}, "--nnodes"},
		{[]string{"--nnodes", "2", "--master-addr", "h", "--master-port", "65535"}, "--master-port"},
	} {
		t.Setenv(job.ClusterKeyEnv, testKey)
		if code, _, errs := runQVD(t, append([]string{"launch"}, c.args...)...); code != exitUsage || !strings.Contains(errs, c.want) {
			t.Errorf("%v: exit %d, %q; want a usage error naming %s", c.args, code, errs, c.want)
		}
	}
	t.Setenv(job.ClusterKeyEnv, "")
	if code, _, errs := runQVD(t, "launch", "--nnodes", "2", "--master-addr", "h"); code != exitUsage || !strings.Contains(errs, job.ClusterKeyEnv) {
		t.Errorf("no key: exit %d, %q; want a usage error asking for a shared key", code, errs)
	}
}
