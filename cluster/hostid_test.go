package cluster

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func TestHostSourcesID(t *testing.T) {
	base := hostSources{BootID: "e584847b-3eb8-4c6e-a242-9d147476103b", IPC: "ipc:[4026531839]", ShmDev: 27, ShmIno: 1}
	cases := []struct {
		name string
		s    hostSources
		same bool // same id as base
	}{
		{"identical", base, true},
		{"other machine or reboot", hostSources{BootID: "00000000-3eb8-4c6e-a242-9d147476103b", IPC: base.IPC, ShmDev: 27, ShmIno: 1}, false},
		{"other IPC namespace", hostSources{BootID: base.BootID, IPC: "ipc:[4026532281]", ShmDev: 27, ShmIno: 1}, false},
		{"own /dev/shm tmpfs", hostSources{BootID: base.BootID, IPC: base.IPC, ShmDev: 112, ShmIno: 1}, false},
		{"other directory as /dev/shm", hostSources{BootID: base.BootID, IPC: base.IPC, ShmDev: 27, ShmIno: 9}, false},
		// The separators keep the fields apart: moving text from one to the next is a change.
		{"shifted fields", hostSources{BootID: base.BootID + "i", IPC: "pc:[4026531839]", ShmDev: 27, ShmIno: 1}, false},
	}
	want := base.id()
	if len(want) != HostIDLen || strings.Trim(want, "0123456789abcdef") != "" {
		t.Fatalf("id %q: want %d lowercase hex digits", want, HostIDLen)
	}
	for _, tc := range cases {
		if got := tc.s.id(); (got == want) != tc.same {
			t.Errorf("%s: id %s, base %s, want same=%v", tc.name, got, want, tc.same)
		}
	}
}

// fakeProc makes a directory laid out like the parts of /proc that readHostSources reads.
func fakeProc(t *testing.T, boot, ipc string) string {
	t.Helper()
	dir := t.TempDir()
	if boot != "-" {
		if err := os.MkdirAll(filepath.Join(dir, "sys/kernel/random"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "sys/kernel/random/boot_id"), []byte(boot), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if ipc != "-" {
		if err := os.MkdirAll(filepath.Join(dir, "self/ns"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(ipc, filepath.Join(dir, "self/ns/ipc")); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestReadHostSources(t *testing.T) {
	shm := t.TempDir()
	file := filepath.Join(shm, "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name      string
		boot, ipc string // "-": missing
		shm       string
		wantErr   bool
	}{
		{"complete", "abc\n", "ipc:[1]", shm, false},
		{"no boot id", "-", "ipc:[1]", shm, true},
		{"empty boot id", "\n", "ipc:[1]", shm, true},
		{"no IPC namespace", "abc\n", "-", shm, true},
		{"no /dev/shm", "abc\n", "ipc:[1]", filepath.Join(shm, "missing"), true},
		{"/dev/shm not a directory", "abc\n", "ipc:[1]", file, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s, err := readHostSources(fakeProc(t, tc.boot, tc.ipc), tc.shm)
			if tc.wantErr {
				if !errors.Is(err, ErrNoHostID) {
					t.Fatalf("got %+v, %v; want ErrNoHostID", s, err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if s.BootID != "abc" || s.IPC != "ipc:[1]" || s.ShmDev == 0 && s.ShmIno == 0 {
				t.Errorf("sources %+v", s)
			}
		})
	}
}

// hostIDChildEnv makes TestHostIDChild, in a re-executed test binary, print its HostID.
const hostIDChildEnv = "QVD_TEST_HOSTID_CHILD"

// TestHostIDChild is the child half of TestHostIDLive; run directly it does nothing.
func TestHostIDChild(t *testing.T) {
	if os.Getenv(hostIDChildEnv) != "1" {
		t.Skip("runs only as TestHostIDLive's child process")
	}
	id, err := HostID()
	if err != nil {
		t.Fatal(err)
	}
	os.Stdout.WriteString("hostid=" + id + "\n")
}

// TestHostIDLive: the real id is stable within a process and the same in a child process,
// which shares the kernel, the IPC namespace and /dev/shm.
func TestHostIDLive(t *testing.T) {
	id, err := HostID()
	if errors.Is(err, ErrNoHostID) {
		t.Skipf("no host id here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	if again, err := HostID(); err != nil || again != id {
		t.Fatalf("second call: %q, %v; first %q", again, err, id)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestHostIDChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), hostIDChildEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	_, child, ok := strings.Cut(string(out), "hostid=")
	if !ok {
		t.Fatalf("child printed no host id:\n%s", out)
	}
	if child, _, _ = strings.Cut(child, "\n"); child != id {
		t.Errorf("child process has host id %q, this one %q", child, id)
	}
}
