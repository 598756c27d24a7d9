package memstat

import (
	"bytes"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"
)

// Limit says which figure Snapshot.Available is.
type Limit uint8

const (
	// LimitUnknown: neither /proc/meminfo nor a cgroup limit could be read.
	LimitUnknown Limit = iota
	// LimitHost: Available is the machine's MemAvailable (no cgroup limit, or a looser one).
	LimitHost
	// LimitCgroup: Available is the memory cgroup's limit less its working set, which is
	// below the machine's MemAvailable (a container's --memory, a SLURM job's allocation).
	LimitCgroup
)

func (l Limit) String() string {
	switch l {
	case LimitHost:
		return "host"
	case LimitCgroup:
		return "cgroup"
	}
	return "unknown"
}

// LimitString says which memory limit applies, with the figures: "cgroup
// /sys/fs/cgroup/memory: limit 256.0 MiB, working set 66.1 MiB, available 189.9 MiB (host:
// 22.8 GiB available of 23.5 GiB)", or "host: 22.8 GiB available of 23.5 GiB (no memory
// cgroup limit)", naming the cgroup's limit when there is one but it is looser.
func (s Snapshot) LimitString() string {
	host := "host: " + FormatBytes(s.HostAvailable) + " available of " + FormatBytes(s.HostTotal)
	dir := s.CgroupDir
	if dir == "" {
		dir = "of this process"
	}
	switch {
	case s.LimitedBy == LimitCgroup:
		return fmt.Sprintf("cgroup %s: limit %s, working set %s, available %s (%s)", dir,
			FormatBytes(s.CgroupLimit), FormatBytes(s.CgroupWorkingSet), FormatBytes(s.Available), host)
	case s.LimitedBy == LimitUnknown:
		return "unknown: neither /proc/meminfo nor a memory cgroup limit could be read"
	case s.CgroupLimit > 0:
		return fmt.Sprintf("%s (memory cgroup %s has the looser limit %s)", host, dir, FormatBytes(s.CgroupLimit))
	}
	return host + " (no memory cgroup limit)"
}

// noLimit: cgroup v1 reports "no limit" as its page counter's maximum in bytes
// (9223372036854771712 with 4 KiB pages), v2 as "max"; any figure from 2^62 up is no limit.
const noLimit = 1 << 62

// Initial buffer sizes of the cgroup files: one number, a few counters, and memory.stat
// (~40 lines in v1 and v2). A buffer found too small grows on the first Read.
const (
	numberBufSize = 64
	eventsBufSize = 512
	statBufSize   = 4 << 10
)

// cgroupLevel is one memory cgroup whose limit may bind: the process's own, or (v2) one of
// its ancestors. In v1, max is memory.limit_in_bytes and current memory.usage_in_bytes.
type cgroupLevel struct {
	dir                string
	max, current, stat procFile
}

// cgroup is the memory cgroup of the process, found on the first Read.
type cgroup struct {
	version int // 0: none found; 1 or 2
	// levels are, in v2, the process's cgroup and its ancestors up to the root of the
	// mount (which, in a container with a cgroup namespace, is the container's own cgroup);
	// in v1 the process's cgroup alone, whose memory.stat carries hierarchical_memory_limit,
	// the lowest limit of it and its ancestors.
	levels []cgroupLevel
	// events is memory.events (v2) or memory.oom_control (v1) of the outermost level with a
	// limit when the cgroup was found (else the process's own), whose oom_kill counts the
	// processes the OOM killer took anywhere under that limit.
	events procFile
}

// findCgroup locates the memory cgroup of the process from procRoot's self/cgroup and
// self/mountinfo, with the mount points looked up under fsRoot ("/" for the live system).
// It reads files once (it allocates); Read then rereads only the cgroup's own files.
func findCgroup(procRoot, fsRoot string) cgroup {
	if fsRoot == "" {
		return cgroup{}
	}
	self, err := os.ReadFile(filepath.Join(procRoot, "self", "cgroup"))
	if err != nil {
		return cgroup{}
	}
	version, cgPath := parseProcCgroup(self)
	if version == 0 {
		return cgroup{}
	}
	mountinfo, _ := os.ReadFile(filepath.Join(procRoot, "self", "mountinfo"))
	mountRoot, mountPoint, ok := parseMountinfo(mountinfo, version, cgPath)
	if !ok {
		// No mountinfo: the usual mount points, taken as the root of the hierarchy.
		mountRoot, mountPoint = "/", "/sys/fs/cgroup"
		if version == 1 {
			mountPoint = "/sys/fs/cgroup/memory"
		}
	}
	mount := filepath.Join(fsRoot, mountPoint)
	rel, _ := relativeTo(cgPath, mountRoot) // "" (the mount point) if not below the mount's root
	dir := filepath.Join(mount, rel)
	if _, err := os.Stat(dir); err != nil {
		dir = mount // the path is not visible here (a container without a cgroup namespace shows the host's)
	}
	c := cgroup{version: version}
	if version == 1 {
		c.levels = []cgroupLevel{newLevel(dir, "memory.limit_in_bytes", "memory.usage_in_bytes")}
		c.events = procFile{path: filepath.Join(dir, "memory.oom_control"), size: eventsBufSize}
		return c
	}
	eventsDir := dir
	for d := dir; ; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "memory.max")); err == nil {
			c.levels = append(c.levels, newLevel(d, "memory.max", "memory.current"))
			if v, ok := parseUint(b); ok && v < noLimit {
				eventsDir = d // the outermost limited level so far
			}
		}
		if d == mount || len(d) <= len(mount) || d == filepath.Dir(d) {
			break
		}
	}
	if len(c.levels) == 0 {
		return cgroup{} // the root cgroup, or no memory controller here
	}
	c.events = procFile{path: filepath.Join(eventsDir, "memory.events"), size: eventsBufSize}
	return c
}

func newLevel(dir, max, current string) cgroupLevel {
	return cgroupLevel{
		dir:     dir,
		max:     procFile{path: filepath.Join(dir, max), size: numberBufSize},
		current: procFile{path: filepath.Join(dir, current), size: numberBufSize},
		stat:    procFile{path: filepath.Join(dir, "memory.stat"), size: statBufSize},
	}
}

// read fills s's cgroup figures: the level with the least available memory (limit less
// working set) gives the limit, usage and working set. It does not allocate.
func (c *cgroup) read(s *Snapshot) {
	// The working set is usage less the inactive file pages, which the kernel reclaims before
	// it OOM-kills: what the kubelet and cAdvisor compare with the limit. v1's total_ figure
	// covers the cgroup's descendants, as its usage does; v2's inactive_file already does.
	inactiveKey := "inactive_file"
	if c.version == 1 {
		inactiveKey = "total_inactive_file"
	}
	best := uint64(1<<64 - 1)
	for i := range c.levels {
		l := &c.levels[i]
		limit, ok := parseUint(l.max.read()) // v2's "max" does not parse: no limit
		var stat []byte
		if c.version == 1 {
			stat = l.stat.read()
			if h, hok := lookup(stat, "hierarchical_memory_limit"); hok && (!ok || h < limit) {
				limit, ok = h, true
			}
		}
		if !ok || limit >= noLimit {
			continue
		}
		usage, ok := parseUint(l.current.read())
		if !ok {
			continue
		}
		if stat == nil {
			stat = l.stat.read()
		}
		inactive, _ := lookup(stat, inactiveKey)
		ws := usage - min(inactive, usage)
		if avail := limit - min(ws, limit); avail < best {
			best = avail
			s.CgroupLimit, s.CgroupUsage, s.CgroupWorkingSet, s.CgroupDir = limit, usage, ws, l.dir
		}
	}
	if b := c.events.read(); b != nil {
		s.CgroupOOMKills, _ = lookup(b, "oom_kill")
	}
}

func (c *cgroup) close() error {
	var first error
	keep := func(err error) {
		if first == nil {
			first = err
		}
	}
	for i := range c.levels {
		keep(c.levels[i].max.close())
		keep(c.levels[i].current.close())
		keep(c.levels[i].stat.close())
	}
	keep(c.events.close())
	return first
}

// parseProcCgroup reads /proc/self/cgroup ("hierarchy-ID:controllers:path" per line) and
// returns where the memory controller is: a v1 hierarchy whose controllers include memory
// (on a hybrid system it holds memory even though a v2 line "0::/..." is present too), else
// the v2 unified hierarchy. version 0: neither.
func parseProcCgroup(b []byte) (version int, cgPath string) {
	for line := range bytes.Lines(b) {
		fields := strings.SplitN(strings.TrimRight(string(line), "\n"), ":", 3)
		if len(fields) != 3 {
			continue
		}
		switch {
		case fields[0] == "0" && fields[1] == "":
			if version == 0 {
				version, cgPath = 2, fields[2]
			}
		case contains(strings.Split(fields[1], ","), "memory"):
			return 1, fields[2]
		}
	}
	return version, cgPath
}

// parseMountinfo finds, in /proc/self/mountinfo, the mount of the cgroup hierarchy: fstype
// cgroup with the memory option (v1) or cgroup2 (v2). Of several, the one whose root holds
// cgPath, with the longest root. It returns the mount's root within the hierarchy and its
// mount point. Lines are "id parent maj:min root mountpoint options [optional...] - fstype
// source superoptions", with blanks in paths written as \040.
func parseMountinfo(b []byte, version int, cgPath string) (root, mountPoint string, ok bool) {
	holds := false // the chosen mount's root holds cgPath
	for line := range bytes.Lines(b) {
		pre, post, found := strings.Cut(strings.TrimRight(string(line), "\n"), " - ")
		if !found {
			continue
		}
		f, g := strings.Fields(pre), strings.Fields(post)
		if len(f) < 5 || len(g) < 3 {
			continue
		}
		switch {
		case version == 2 && g[0] == "cgroup2":
		case version == 1 && g[0] == "cgroup" && contains(strings.Split(g[2], ","), "memory"):
		default:
			continue
		}
		r, mp := unescapeMount(f[3]), unescapeMount(f[4])
		_, h := relativeTo(cgPath, r)
		if !ok || (h && (!holds || len(r) > len(root))) {
			root, mountPoint, ok, holds = r, mp, true, h
		}
	}
	return root, mountPoint, ok
}

// relativeTo is p below root ("/a/b" below "/a" is "b", "/a" below "/a" is ""), and whether
// p is root or below it.
func relativeTo(p, root string) (string, bool) {
	p, root = path.Clean("/"+p), path.Clean("/"+root)
	switch {
	case p == root:
		return "", true
	case root == "/":
		return p[1:], true
	}
	rest, ok := strings.CutPrefix(p, root+"/")
	return rest, ok
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a blank, \011, \012, \134).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1]) && isOctal(s[i+2]) && isOctal(s[i+3]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(c byte) bool { return c >= '0' && c <= '7' }

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}
