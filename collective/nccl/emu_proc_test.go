//go:build cuda

package nccl

// Ranks in separate processes: the test binary runs again as rank 1 (TestEmuHelperRank), which
// joins rank 0's communicator through the emulated NCCL's shared-memory segment and is then
// killed. Rank 0's collective must fail with a peer error soon after (the emulator notices
// the dead process), not wait out its timeout.

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
)

const helperIDEnv = "QVD_NCCL_EMU_HELPER_ID"

// TestEmuHelperRank is rank 1 of TestEmuKilledProcess's group when run by it; it skips
// otherwise.
func TestEmuHelperRank(t *testing.T) {
	idHex := os.Getenv(helperIDEnv)
	if idHex == "" {
		t.Skip("run by TestEmuKilledProcess")
	}
	b, err := hex.DecodeString(idHex)
	if err != nil || len(b) != uniqueIDBytes {
		t.Fatalf("%s: %v", helperIDEnv, err)
	}
	var id uniqueID
	copy(id.Internal[:], b)
	c := &Comm{rank: 1, size: 2, device: 0}
	if err := c.setup(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := c.initComm(ctx, id); err != nil {
		t.Fatal(err)
	}
	fmt.Println("joined")
	time.Sleep(time.Minute) // until killed
}

func TestEmuKilledProcess(t *testing.T) {
	emulated(t, 1)
	c := &Comm{rank: 0, size: 2, device: 0}
	if err := c.setup(); err != nil {
		t.Fatal(err)
	}
	defer c.release()
	id, err := c.newID()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestEmuHelperRank$", "-test.v")
	cmd.Env = append(os.Environ(), helperIDEnv+"="+hex.EncodeToString(id.Internal[:]))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := c.initComm(ctx, id); err != nil {
		t.Fatal(err)
	}
	// The helper has attached (the communicator exists); wait for it to say so, then kill it.
	buf := make([]byte, 4096)
	var said []byte
	for !containsLine(said, "joined") {
		n, err := out.Read(buf)
		if err != nil {
			t.Fatalf("rank 1's process: %v (it said %q)", err, said)
		}
		said = append(said, buf[:n]...)
	}
	// Not reaped until the test ends: a zombie, as a crashed rank is until its launcher waits.
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	leave, err := c.enter()
	if err != nil {
		t.Fatal(err)
	}
	defer leave()
	p, free, err := devBuf(half.FP32, 100)
	if err != nil {
		t.Fatal(err)
	}
	defer free()
	c.mu.Lock()
	err = c.deviceRun(ctx, kindAllReduce, uintptr(p), 100, nil, 0, true, half.FP32, collective.Sum, 0)
	c.abort() // as Comm.fail does: the collective gives up, so the buffer can be freed
	c.mu.Unlock()
	if !errors.Is(err, collective.ErrPeerGone) {
		t.Fatalf("an all-reduce with a killed peer: %v, want an error wrapping collective.ErrPeerGone", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("the all-reduce failed after %v", took)
	}
	t.Logf("after %v: %v", time.Since(start), err)
}

func containsLine(b []byte, line string) bool {
	return slices.Contains(strings.Split(string(b), "\n"), line)
}
