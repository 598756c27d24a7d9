package memstat

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

const (
	mib = 1 << 20
	gib = 1 << 30
	// v1's "no limit": PAGE_COUNTER_MAX pages of 4 KiB.
	v1Unlimited = "9223372036854771712\n"
)

func n(v uint64) string { return strconv.FormatUint(v, 10) + "\n" }

// hostMeminfo is a machine with 24 GiB total, 20 GiB available.
var hostMeminfo = "MemTotal:       " + strconv.Itoa(24<<20) + " kB\nMemAvailable:   " + strconv.Itoa(20<<20) + " kB\n"

const (
	mountV2         = "30 22 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"
	mountV1Hybrid   = "30 22 0:27 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n40 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n31 30 0:28 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n34 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
	mountV1InDocker = "700 690 0:50 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs rw,mode=755\n705 700 0:31 /docker/abc /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:15 - cgroup cgroup rw,memory\n706 700 0:28 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n"
)

// v2Stat is a v2 memory.stat with inactive_file set (and a decoy key that shares its prefix).
func v2Stat(inactive uint64) string {
	return "anon 1234\nfile 99999999\nactive_file 5\ninactive_file " + n(inactive) + "inactive_file_x 77\n"
}

// TestCgroupFigures: the limit, usage, working set and OOM kills of the process's memory
// cgroup, v1 and v2, in a container or a SLURM job, and the smaller of host and cgroup
// available memory, from fake /proc and /sys/fs/cgroup trees.
func TestCgroupFigures(t *testing.T) {
	slurm := "/system.slice/slurmstepd.scope/job_42/step_0/user/task_0"
	cg := "fs/sys/fs/cgroup"
	cases := []struct {
		name  string
		files map[string]string
		want  Snapshot // the cgroup fields, Available, Total and LimitedBy
	}{
		{
			name: "v2 container (docker --memory 256m, cgroup namespace)",
			files: map[string]string{
				"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": mountV2,
				cg + "/memory.max": n(256 * mib), cg + "/memory.current": n(100 * mib), cg + "/memory.stat": v2Stat(20 * mib),
				cg + "/memory.events": "low 0\nhigh 0\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n",
			},
			want: Snapshot{CgroupLimit: 256 * mib, CgroupUsage: 100 * mib, CgroupWorkingSet: 80 * mib, CgroupDir: cg, CgroupOOMKills: 2,
				Available: 176 * mib, Total: 256 * mib, LimitedBy: LimitCgroup},
		},
		{
			name: "v2 SLURM job: the job's limit binds, two levels up; kills counted under it",
			files: map[string]string{
				"proc/self/cgroup": "0::" + slurm + "\n", "proc/self/mountinfo": mountV2,
				cg + "/system.slice/memory.max":                         "max\n",
				cg + "/system.slice/slurmstepd.scope/memory.max":        "max\n",
				cg + "/system.slice/slurmstepd.scope/job_42/memory.max": n(4 * gib), cg + "/system.slice/slurmstepd.scope/job_42/memory.current": n(3 * gib),
				cg + "/system.slice/slurmstepd.scope/job_42/memory.stat":       v2Stat(gib),
				cg + "/system.slice/slurmstepd.scope/job_42/memory.events":     "oom_kill 4\n",
				cg + "/system.slice/slurmstepd.scope/job_42/step_0/memory.max": "max\n",
				cg + slurm + "/memory.max":                                     "max\n", cg + slurm + "/memory.current": n(gib), cg + slurm + "/memory.events": "oom_kill 1\n",
			},
			want: Snapshot{CgroupLimit: 4 * gib, CgroupUsage: 3 * gib, CgroupWorkingSet: 2 * gib, CgroupDir: cg + "/system.slice/slurmstepd.scope/job_42", CgroupOOMKills: 4,
				Available: 2 * gib, Total: 4 * gib, LimitedBy: LimitCgroup},
		},
		{
			name: "v2 nested: the inner limit leaves less",
			files: map[string]string{
				"proc/self/cgroup": "0::/job/step\n", "proc/self/mountinfo": mountV2,
				cg + "/job/memory.max": n(8 * gib), cg + "/job/memory.current": n(gib), cg + "/job/memory.stat": v2Stat(0),
				cg + "/job/step/memory.max": n(2 * gib), cg + "/job/step/memory.current": n(1900 * mib), cg + "/job/step/memory.stat": v2Stat(0),
				cg + "/job/memory.events": "oom_kill 1\n",
			},
			want: Snapshot{CgroupLimit: 2 * gib, CgroupUsage: 1900 * mib, CgroupWorkingSet: 1900 * mib, CgroupDir: cg + "/job/step", CgroupOOMKills: 1,
				Available: 148 * mib, Total: 2 * gib, LimitedBy: LimitCgroup},
		},
		{
			name: "v2 without a limit: the host's figures, the leaf's kills",
			files: map[string]string{
				"proc/self/cgroup": "0::/user.slice/session-1.scope\n", "proc/self/mountinfo": mountV2,
				cg + "/user.slice/memory.max": "max\n", cg + "/user.slice/session-1.scope/memory.max": "max\n",
				cg + "/user.slice/session-1.scope/memory.current": n(mib), cg + "/user.slice/session-1.scope/memory.events": "oom_kill 3\n",
			},
			want: Snapshot{CgroupOOMKills: 3, Available: 20 * gib, Total: 24 * gib, LimitedBy: LimitHost},
		},
		{
			name: "v2 limit above what the host has available",
			files: map[string]string{
				"proc/self/cgroup": "0::/big\n", "proc/self/mountinfo": mountV2,
				cg + "/big/memory.max": n(64 * gib), cg + "/big/memory.current": n(gib), cg + "/big/memory.stat": v2Stat(0),
			},
			want: Snapshot{CgroupLimit: 64 * gib, CgroupUsage: gib, CgroupWorkingSet: gib, CgroupDir: cg + "/big",
				Available: 20 * gib, Total: 24 * gib, LimitedBy: LimitHost},
		},
		{
			name: "v2 working set over the limit: nothing available, and it says so",
			files: map[string]string{
				"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": mountV2,
				cg + "/memory.max": n(256 * mib), cg + "/memory.current": n(300 * mib), cg + "/memory.stat": v2Stat(0),
			},
			want: Snapshot{CgroupLimit: 256 * mib, CgroupUsage: 300 * mib, CgroupWorkingSet: 300 * mib, CgroupDir: cg,
				Available: 0, Total: 256 * mib, LimitedBy: LimitCgroup},
		},
		{
			name: "v2 without mountinfo: /sys/fs/cgroup is assumed",
			files: map[string]string{
				"proc/self/cgroup":   "0::/c\n",
				cg + "/c/memory.max": n(gib), cg + "/c/memory.current": n(512 * mib), cg + "/c/memory.stat": v2Stat(0),
			},
			want: Snapshot{CgroupLimit: gib, CgroupUsage: 512 * mib, CgroupWorkingSet: 512 * mib, CgroupDir: cg + "/c",
				Available: 512 * mib, Total: gib, LimitedBy: LimitCgroup},
		},
		{
			name: "v1 in docker without a cgroup namespace: the mount's root is the container's cgroup",
			files: map[string]string{
				"proc/self/cgroup":                   "12:memory:/docker/abc\n11:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n",
				"proc/self/mountinfo":                mountV1InDocker,
				cg + "/memory/memory.limit_in_bytes": n(512 * mib), cg + "/memory/memory.usage_in_bytes": n(300 * mib),
				cg + "/memory/memory.stat":        "cache 1\ninactive_file 999\ntotal_inactive_file " + n(100*mib) + "hierarchical_memory_limit " + v1Unlimited,
				cg + "/memory/memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n",
			},
			want: Snapshot{CgroupLimit: 512 * mib, CgroupUsage: 300 * mib, CgroupWorkingSet: 200 * mib, CgroupDir: cg + "/memory", CgroupOOMKills: 5,
				Available: 312 * mib, Total: 512 * mib, LimitedBy: LimitCgroup},
		},
		{
			name: "v1 hybrid host: an ancestor's limit through hierarchical_memory_limit",
			files: map[string]string{
				"proc/self/cgroup":    "9:name=systemd:/\n4:memory:/process_api/x\n1:cpu:/\n0::/\n",
				"proc/self/mountinfo": mountV1Hybrid,
				cg + "/memory/process_api/x/memory.limit_in_bytes": v1Unlimited, cg + "/memory/process_api/x/memory.usage_in_bytes": n(200 * mib),
				cg + "/memory/process_api/x/memory.stat":        "total_inactive_file " + n(50*mib) + "hierarchical_memory_limit " + n(gib),
				cg + "/memory/process_api/x/memory.oom_control": "oom_kill 0\n",
			},
			want: Snapshot{CgroupLimit: gib, CgroupUsage: 200 * mib, CgroupWorkingSet: 150 * mib, CgroupDir: cg + "/memory/process_api/x",
				Available: 874 * mib, Total: gib, LimitedBy: LimitCgroup},
		},
		{
			name: "v1 unlimited",
			files: map[string]string{
				"proc/self/cgroup": "4:memory:/x\n", "proc/self/mountinfo": mountV1Hybrid,
				cg + "/memory/x/memory.limit_in_bytes": v1Unlimited, cg + "/memory/x/memory.usage_in_bytes": n(mib),
				cg + "/memory/x/memory.stat": "hierarchical_memory_limit " + v1Unlimited,
			},
			want: Snapshot{Available: 20 * gib, Total: 24 * gib, LimitedBy: LimitHost},
		},
		{
			name:  "no memory controller in /proc/self/cgroup",
			files: map[string]string{"proc/self/cgroup": "garbage\n3:cpu:/\n"},
			want:  Snapshot{Available: 20 * gib, Total: 24 * gib, LimitedBy: LimitHost},
		},
		{
			name: "malformed cgroup files read as no limit",
			files: map[string]string{
				"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": mountV2,
				cg + "/memory.max": "lots\n", cg + "/memory.current": "x\n", cg + "/memory.events": "oom_kill\n",
			},
			want: Snapshot{Available: 20 * gib, Total: 24 * gib, LimitedBy: LimitHost},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			files := map[string]string{"proc/meminfo": hostMeminfo}
			for k, v := range tc.files {
				files[k] = v
			}
			root := fakeProc(t, files)
			r := NewReaderAtRoots(filepath.Join(root, "proc"), filepath.Join(root, "fs"))
			defer r.Close()
			want := tc.want
			if want.CgroupDir != "" {
				want.CgroupDir = filepath.Join(root, want.CgroupDir)
			}
			for range 2 { // the second Read rereads the open files
				s := r.Read()
				got := Snapshot{CgroupLimit: s.CgroupLimit, CgroupUsage: s.CgroupUsage, CgroupWorkingSet: s.CgroupWorkingSet,
					CgroupDir: s.CgroupDir, CgroupOOMKills: s.CgroupOOMKills, Available: s.Available, Total: s.Total, LimitedBy: s.LimitedBy}
				if got != want {
					t.Fatalf("got  %+v\nwant %+v", got, want)
				}
				if s.HostAvailable != 20*gib || s.HostTotal != 24*gib {
					t.Fatalf("host figures %d, %d", s.HostAvailable, s.HostTotal)
				}
			}
		})
	}
}

// TestCgroupRereadAndNoHost: new usage and kills are seen through the open files, and a
// cgroup limit stands in for an unreadable /proc/meminfo.
func TestCgroupRereadAndNoHost(t *testing.T) {
	cg := "fs/sys/fs/cgroup"
	root := fakeProc(t, map[string]string{
		"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": mountV2,
		cg + "/memory.max": n(gib), cg + "/memory.current": n(100 * mib), cg + "/memory.stat": v2Stat(0), cg + "/memory.events": "oom_kill 0\n",
	})
	r := NewReaderAtRoots(filepath.Join(root, "proc"), filepath.Join(root, "fs"))
	defer r.Close()
	if s := r.Read(); s.Available != 924*mib || s.LimitedBy != LimitCgroup || s.HostAvailable != 0 || s.Total != gib {
		t.Fatalf("first: %+v", s)
	}
	for name, v := range map[string]string{"memory.current": n(900 * mib), "memory.events": "oom_kill 1\n"} {
		if err := os.WriteFile(filepath.Join(root, cg, name), []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if s := r.Read(); s.Available != 124*mib || s.CgroupOOMKills != 1 {
		t.Fatalf("after the rewrite: %+v", s)
	}
	if n := testing.AllocsPerRun(100, func() { r.Read() }); n != 0 {
		t.Errorf("Read with a cgroup allocates %.1f times per call", n)
	}
}

func TestParseProcCgroupAndMountinfo(t *testing.T) {
	for _, c := range []struct {
		in      string
		version int
		path    string
	}{
		{"0::/user.slice/a.scope\n", 2, "/user.slice/a.scope"},
		{"12:memory:/docker/abc\n0::/\n", 1, "/docker/abc"},
		{"0::/\n4:cpu,memory:/x\n", 1, "/x"}, // hybrid: memory is on v1 wherever the line is
		{"4:cpu:/x\n1:name=systemd:/\n", 0, ""},
		{"", 0, ""},
		{"0::/with:colon\n", 2, "/with:colon"},
	} {
		if v, p := parseProcCgroup([]byte(c.in)); v != c.version || p != c.path {
			t.Errorf("parseProcCgroup(%q) = %d, %q; want %d, %q", c.in, v, p, c.version, c.path)
		}
	}
	for _, c := range []struct {
		in, cgPath  string
		version     int
		root, mount string
		ok          bool
	}{
		{mountV2, "/a", 2, "/", "/sys/fs/cgroup", true},
		{mountV1Hybrid, "/a", 1, "/", "/sys/fs/cgroup/memory", true},
		{mountV1Hybrid, "/a", 2, "/", "/sys/fs/cgroup/unified", true},
		{mountV1InDocker, "/docker/abc", 1, "/docker/abc", "/sys/fs/cgroup/memory", true},
		// Two v2 mounts: the one whose root holds the path, the deepest.
		{"1 0 0:1 /other /mnt/other rw - cgroup2 cgroup2 rw\n2 0 0:1 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n3 0 0:1 /job /mnt/job rw - cgroup2 cgroup2 rw\n",
			"/job/step", 2, "/job", "/mnt/job", true},
		{"1 0 0:1 / /mnt/cgroup\\040v2 rw - cgroup2 none rw\n", "/", 2, "/", "/mnt/cgroup v2", true},
		{"1 0 0:1 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n", "/", 1, "", "", false},
		{"junk\n", "/", 2, "", "", false},
	} {
		root, mount, ok := parseMountinfo([]byte(c.in), c.version, c.cgPath)
		if root != c.root || mount != c.mount || ok != c.ok {
			t.Errorf("parseMountinfo(%q, v%d, %q) = %q, %q, %v; want %q, %q, %v", c.in, c.version, c.cgPath, root, mount, ok, c.root, c.mount, c.ok)
		}
	}
}

// TestCgroupLimitInContainer runs a static probe (testdata/cgroupprobe) in a container
// started with --memory 256m, from an image built FROM scratch, and checks what the OS gives
// it: the limit is 256 MiB and applies, touching 64 MiB shows in the cgroup's working set,
// and a child the OOM killer takes in that cgroup is counted. Skipped without docker.
func TestCgroupLimitInContainer(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a container")
	}
	if runtime.GOOS != "linux" {
		t.Skip("cgroups are Linux only")
	}
	docker, err := exec.LookPath("docker")
	if err != nil {
		t.Skip("no docker command")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	if out, err := exec.CommandContext(ctx, docker, "info", "--format", "{{.ServerVersion}}").CombinedOutput(); err != nil {
		t.Skipf("docker is not usable: %v: %s", err, out)
	}
	goTool, err := exec.LookPath("go")
	if err != nil {
		goTool = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	dir := t.TempDir()
	build := exec.CommandContext(ctx, goTool, "build", "-trimpath", "-o", filepath.Join(dir, "probe"), "./testdata/cgroupprobe")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building the probe: %v\n%s", err, out)
	}
	dockerfile := "FROM scratch\nCOPY probe /probe\nENTRYPOINT [\"/probe\"]\n"
	if err := os.WriteFile(filepath.Join(dir, "Dockerfile"), []byte(dockerfile), 0o644); err != nil {
		t.Fatal(err)
	}
	tag := fmt.Sprintf("qvd-memstat-probe:%d", os.Getpid())
	if out, err := exec.CommandContext(ctx, docker, "build", "-q", "-t", tag, dir).CombinedOutput(); err != nil {
		t.Fatalf("docker build: %v\n%s", err, out)
	}
	defer exec.Command(docker, "rmi", "-f", tag).Run()
	// --memory-swap equal to --memory: no swap, so the hog is killed rather than swapped out.
	run := exec.CommandContext(ctx, docker, "run", "--rm", "--memory", "256m", "--memory-swap", "256m", tag)
	var stderr strings.Builder
	run.Stderr = &stderr
	out, err := run.Output()
	if err != nil {
		t.Fatalf("docker run: %v\n%s\n%s", err, out, stderr.String())
	}
	var got struct {
		Before, After, AfterOOM Snapshot
		Child                   string
	}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("probe output %q: %v", out, err)
	}
	t.Logf("in the container: before %+v\nafter touching 64 MiB %+v\nafter the child (%s) %+v", got.Before, got.After, got.Child, got.AfterOOM)
	const limit = 256 << 20
	b, a := got.Before, got.After
	switch {
	case b.CgroupLimit != limit || b.Total != limit:
		t.Errorf("limit %d, total %d; want %d (256 MiB)", b.CgroupLimit, b.Total, limit)
	case b.LimitedBy != LimitCgroup || b.Available > limit || b.Available != b.CgroupLimit-b.CgroupWorkingSet:
		t.Errorf("available %d by %v; want the cgroup's %d - %d", b.Available, b.LimitedBy, b.CgroupLimit, b.CgroupWorkingSet)
	case b.HostAvailable <= limit:
		t.Errorf("host available %d: the test needs a host with more than 256 MiB free", b.HostAvailable)
	case b.CgroupDir == "":
		t.Error("no cgroup directory")
	}
	// 64 MiB touched: the working set grows by about that (the heap maps a little more).
	if grew := int64(a.CgroupWorkingSet) - int64(b.CgroupWorkingSet); grew < 60<<20 || grew > 96<<20 {
		t.Errorf("working set grew by %d bytes after touching 64 MiB", grew)
	}
	if fell := int64(b.Available) - int64(a.Available); fell < 60<<20 {
		t.Errorf("available fell by %d bytes after touching 64 MiB", fell)
	}
	if got.Child != "signal: killed" {
		t.Skipf("the child was not OOM-killed (%s); OOM counting not checked", got.Child)
	}
	if got.AfterOOM.CgroupOOMKills != b.CgroupOOMKills+1 {
		t.Errorf("OOM kills %d before, %d after the child was killed; want one more", b.CgroupOOMKills, got.AfterOOM.CgroupOOMKills)
	}
}
