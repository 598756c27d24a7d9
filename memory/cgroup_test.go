package memory

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/memstat"
)

// TestMinAvailableInCgroup: inside a container (here a fake one: a 24 GiB host with 20 GiB
// available, a cgroup limit of 256 MiB with 240 MiB in its working set), min_available: 10%
// is 10% of the limit and the cgroup's 16 MiB left is pressure, named with the cgroup's
// figures; the host-wide figures alone would see 20 GiB free.
func TestMinAvailableInCgroup(t *testing.T) {
	root := t.TempDir()
	cg := filepath.Join(root, "fs", "sys", "fs", "cgroup")
	for name, content := range map[string]string{
		filepath.Join(root, "proc", "meminfo"):           "MemTotal: 25165824 kB\nMemAvailable: 20971520 kB\n",
		filepath.Join(root, "proc", "self", "cgroup"):    "0::/\n",
		filepath.Join(root, "proc", "self", "mountinfo"): "30 22 0:27 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
		filepath.Join(cg, "memory.max"):                  "268435456\n",
		filepath.Join(cg, "memory.current"):              "262144000\n", // 250 MiB
		filepath.Join(cg, "memory.stat"):                 "anon 1\ninactive_file 10485760\n",
		filepath.Join(cg, "memory.events"):               "oom_kill 0\n",
	} {
		if err := os.MkdirAll(filepath.Dir(name), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(name, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	m, _ := newTestMonitor(t, Config{MinAvailable: "10%"}, NewHostAtRoots(filepath.Join(root, "proc"), filepath.Join(root, "fs")), nil)
	r := m.Observe(1, nil)
	want := "available memory 16.0 MiB (memory cgroup " + cg + ": limit 256.0 MiB, working set 240.0 MiB) is below memory.min_available 10% (25.6 MiB of 256.0 MiB)"
	if !r.Pressure || r.Reason != want {
		t.Fatalf("pressure %v, reason %q\nwant %q", r.Pressure, r.Reason, want)
	}
	if got := r.Line(); !strings.Contains(got, "Free: 16.0 MiB of cgroup limit 256.0 MiB") {
		t.Errorf("Line() = %q", got)
	}
	if got := r.LimitLine(); !strings.HasPrefix(got, "cgroup "+cg+": limit 256.0 MiB, working set 240.0 MiB, available 16.0 MiB (host: 20.0 GiB available of 24.0 GiB)") {
		t.Errorf("LimitLine() = %q", got)
	}
	// A kill under the limit: reported once, as pressure starting again although it is on.
	if err := os.WriteFile(filepath.Join(cg, "memory.events"), []byte("oom_kill 2\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	r = m.Observe(2, nil)
	if r.NewOOMKills != 2 || !r.PressureStarted || !strings.Contains(r.Reason, "the OOM killer took 2 process(es) under the memory cgroup's limit since the previous step (oom_kill 2 in "+cg+")") {
		t.Fatalf("after 2 kills: %d new, started %v, %q", r.NewOOMKills, r.PressureStarted, r.Reason)
	}
	if r = m.Observe(3, nil); r.NewOOMKills != 0 || r.PressureStarted {
		t.Fatalf("no new kill: %d new, started %v", r.NewOOMKills, r.PressureStarted)
	}
}

// TestOOMKillsAndCgroupFigures: kills before the first Observe are not new; a kill is
// pressure even with memory to spare; the cgroup's available 0 is none left, not unknown;
// Line and LimitLine name the limit that applies.
func TestOOMKillsAndCgroupFigures(t *testing.T) {
	snap := memstat.Snapshot{HeapInUse: 1 << 20, Available: 200 << 20, Total: 256 << 20, LimitedBy: memstat.LimitCgroup,
		HostAvailable: 20 << 30, HostTotal: 24 << 30, CgroupLimit: 256 << 20, CgroupUsage: 60 << 20, CgroupWorkingSet: 56 << 20,
		CgroupDir: "/sys/fs/cgroup", CgroupOOMKills: 5}
	h := &fakeHost{snap: snap}
	m, _ := newTestMonitor(t, Config{MinAvailable: "10%"}, h, nil)
	if r := m.Observe(1, nil); r.Pressure || r.NewOOMKills != 0 {
		t.Fatalf("kills from before the run: %+v", r)
	}
	h.set(func(f *fakeHost) { f.snap.CgroupOOMKills = 6 })
	if r := m.Observe(2, nil); !r.Pressure || !r.PressureStarted || r.NewOOMKills != 1 || !strings.Contains(r.Reason, "OOM killer took 1") {
		t.Fatalf("one kill: %+v", r)
	}
	h.set(func(f *fakeHost) { f.snap.Available, f.snap.CgroupWorkingSet = 0, 256<<20 })
	r := m.Observe(3, nil)
	if !r.Pressure || !strings.Contains(r.Reason, "available memory 0 B (memory cgroup /sys/fs/cgroup: limit 256.0 MiB") {
		t.Fatalf("cgroup full: %+v", r)
	}
	if got, want := r.Line(), "Memory - Allocated: 1.0 MiB, Free: 0 B of cgroup limit 256.0 MiB, Max Used: 1.0 MiB"; got != want {
		t.Errorf("Line() = %q, want %q", got, want)
	}
	for _, c := range []struct {
		s    memstat.Snapshot
		want string
	}{
		{memstat.Snapshot{LimitedBy: memstat.LimitHost, HostAvailable: 20 << 30, HostTotal: 24 << 30}, "host: 20.0 GiB available of 24.0 GiB (no memory cgroup limit)"},
		{memstat.Snapshot{LimitedBy: memstat.LimitHost, HostAvailable: 20 << 30, HostTotal: 24 << 30, CgroupLimit: 64 << 30, CgroupDir: "/sys/fs/cgroup/big"},
			"host: 20.0 GiB available of 24.0 GiB (memory cgroup /sys/fs/cgroup/big has the looser limit 64.0 GiB)"},
		{memstat.Snapshot{}, "unknown: neither /proc/meminfo nor a memory cgroup limit could be read"},
	} {
		if got := (Report{Host: c.s}).LimitLine(); got != c.want {
			t.Errorf("LimitLine() = %q, want %q", got, c.want)
		}
	}
}
