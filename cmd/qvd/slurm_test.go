package main

import (
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/launch"
)

// TestSlurmStepMatchesLaunch runs a two-task step without SLURM: two `qvd train` processes
// with the variables srun would set, on 127.0.0.1. Task 1 must join as rank 1 and the job must
// end with the weights `qvd launch --nproc 2` reaches.
func TestSlurmStepMatchesLaunch(t *testing.T) {
	needDataset(t)
	if testing.Short() {
		t.Skip("multi-process")
	}
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	common := []string{"-c", "../../configs/fashion-mlp.yaml", "--epochs", "1", "--train-subset", "1024",
		"--test-subset", "256", "--seed", "5", "--quiet", "--micro-batch", "16", "--max-steps", "6"}
	dir := t.TempDir()
	slurmOut := filepath.Join(dir, "slurm")
	var outs []*syncBuffer
	var errs []error
	done := make(chan int, 2)
	for procid := range 2 {
		cmd, out := qvdCmd(t, testKey, append([]string{"train", "--out", slurmOut, "--grpc-bind", "127.0.0.1:0"}, common...)...)
		cmd.Env = append(cmd.Env, "SLURM_STEP_ID=0", "SLURM_JOB_ID=77", "SLURM_NTASKS=2", "SLURM_JOB_NODELIST=127.0.0.1",
			"SLURMD_NODENAME=127.0.0.1", "QVD_PORT="+fmt.Sprint(port), "SLURM_PROCID="+fmt.Sprint(procid), "SLURM_LOCALID="+fmt.Sprint(procid), "SLURM_TASKS_PER_NODE=2")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		outs = append(outs, out)
		errs = append(errs, nil)
		go func(i int) { errs[i] = cmd.Wait(); done <- i }(procid)
	}
	for range 2 {
		select {
		case <-done:
		case <-time.After(2 * time.Minute):
			t.Fatalf("the step did not finish:\n%s\n%s", outs[0], outs[1])
		}
	}
	for i, err := range errs {
		if err != nil {
			t.Fatalf("task %d: %v\n%s", i, err, outs[i])
		}
	}
	if w := outs[1].String(); !strings.Contains(w, "slurm-77-1") || !strings.Contains(w, `"rank": 1`) {
		t.Fatalf("task 1 did not run as the worker slurm-77-1 with rank 1:\n%s", w)
	}
	t.Setenv(asQVD, "1")
	launchOut := filepath.Join(dir, "launch")
	if code, out, errOut := runQVD(t, append([]string{"launch", "--nproc", "2", "--out", launchOut}, common...)...); code != exitOK {
		t.Fatalf("launch: exit %d\n%s\n%s", code, out, errOut)
	}
	if d := maxDiff(t, readModel(t, filepath.Join(launchOut, "checkpoints")), readModel(t, filepath.Join(slurmOut, "checkpoints"))); d != 0 {
		t.Fatalf("the SLURM step ends %g away from qvd launch --nproc 2", d)
	}
}
