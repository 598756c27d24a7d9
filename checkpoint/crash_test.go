package checkpoint

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"
)

// crashDirEnv switches the test binary into the saver of TestKilledWhileSaving.
const crashDirEnv = "QVD_CHECKPOINT_CRASH_DIR"

// TestMain lets the test binary double as a process that saves checkpoints until it is
// killed, so the crash test kills a real process rather than simulating one.
func TestMain(m *testing.M) {
	if dir := os.Getenv(crashDirEnv); dir != "" {
		os.Exit(saveForever(dir))
	}
	os.Exit(m.Run())
}

func saveForever(dir string) int {
	mgr, err := NewManager(dir, 3)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	start := int64(1)
	if steps, _ := mgr.List(); len(steps) > 0 {
		start = steps[len(steps)-1] + 1
	}
	data := make([]float32, 64<<10) // 256 KiB per file: saves take long enough to be killed mid-way
	for step := start; ; step++ {
		for i := range data {
			data[i] = float32(step)
		}
		files := map[string]func(io.Writer) error{}
		for _, name := range []string{"model.safetensors", "optimizer-00000.safetensors", "optimizer-00001.safetensors"} {
			files[name] = func(w io.Writer) error {
				return WriteSafetensors(w, []Tensor{{Name: "w", Shape: []int{len(data)}, Data: data}}, nil)
			}
		}
		if _, err := mgr.Save(step, files, map[string]int64{"step": step}); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println(step)
	}
}

// TestKilledWhileSaving kills (SIGKILL) a process in the middle of saving checkpoints in a
// loop, at a different point of the save each time, and checks that every checkpoint it
// had committed still verifies and that the next run carries on in the same directory.
func TestKilledWhileSaving(t *testing.T) {
	if testing.Short() {
		t.Skip("starts subprocesses")
	}
	dir := filepath.Join(t.TempDir(), "checkpoints")
	for round, delay := range []time.Duration{0, 150 * time.Microsecond, 700 * time.Microsecond, 2 * time.Millisecond, 5 * time.Millisecond} {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), crashDirEnv+"="+dir)
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// Let it commit a few checkpoints, so pruning is under way too, then kill it.
		sc := bufio.NewScanner(stdout)
		var last int64
		for i := 0; i < 4 && sc.Scan(); i++ {
			last, _ = strconv.ParseInt(sc.Text(), 10, 64)
		}
		time.Sleep(delay)
		cmd.Process.Kill()
		cmd.Wait()
		if last == 0 {
			t.Fatalf("round %d: the saver committed nothing before it was killed", round)
		}

		steps, err := listSteps(dir)
		if err != nil {
			t.Fatal(err)
		}
		if len(steps) == 0 || steps[len(steps)-1] < last {
			t.Fatalf("round %d: List() = %v after the saver reported step %d committed", round, steps, last)
		}
		for _, step := range steps {
			if _, err := Open(filepath.Join(dir, StepDirName(step))); err != nil {
				t.Errorf("round %d (killed %v after step %d): a committed checkpoint does not verify: %v", round, delay, last, err)
			}
		}
		entries, _ := os.ReadDir(dir)
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		t.Logf("round %d: killed %v after step %d; directory holds %v", round, delay, last, names)
		c, skipped, err := Latest(dir)
		if err != nil || len(skipped) > 0 || c.Step() != steps[len(steps)-1] {
			t.Errorf("round %d: Latest = %v, %v, %v; want step %d", round, c, skipped, err, steps[len(steps)-1])
		}
	}
}
