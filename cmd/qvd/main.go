// Command qvd is qvd's one binary: `qvd train` and `qvd join` run a training job's processes,
// and the other commands launch, inspect and measure jobs.
//
// Its role is flags → config → one library call → exit code: each command registers its
// flags, maps them to a configs.Config or a library package's options, calls one entry point
// (job.Run trains; launch, infer, job/estimate, collective/bench and internal/cli do the
// rest), and maps the returned error to an exit code. It must not hold library logic —
// searches, planners, validation beyond a flag's own syntax, assembly of parts — nor
// anything a test could only reach by running the binary: that belongs in the packages
// below it (docs/architecture.md).
//
// It is linked dynamically, with cgo: the CPU backend calls OpenBLAS (libopenblas) and its C
// kernels, and a build with -tags cuda adds the CUDA backend and NCCL.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/qvd/qvd/internal/cli"
	"github.com/qvd/qvd/launch"
)

// Exit codes.
const (
	exitOK          = 0
	exitFailure     = 1
	exitUsage       = 2   // bad flags or configuration
	exitInterrupted = 130 // stopped after saving a checkpoint (128+SIGINT, as shells report); a SIGTERM makes it 143 (see signalExitCode)
	// exitPreempted: SIGUSR1 (SLURM's `sbatch --signal=USR1@60` before the time limit or a
	// preemption) stopped the command after saving a checkpoint: requeue the job and resume
	// with --resume auto (scripts/slurm/qvd.sbatch does). 128+SIGUSR1, by the rule of 130 and
	// 143, which also makes it the code srun reports: srun exits with its tasks' highest
	// code, and a rank that stopped because another rank's signal came first exits 130.
	exitPreempted = 128 + int(syscall.SIGUSR1)
)

const usage = `qvd — a distributed deep-learning trainer in one binary

Usage:
  qvd train [-c CONFIG] [flags]   train a model (default config: the embedded fashion-mlp)
  qvd train ... --nodes N --bind HOST:PORT
                                  coordinate a job of N processes; the others run qvd join
  qvd join PEER [--bind HOST:PORT]
                                  join a cluster through any member and train the job it runs
  qvd launch --nproc N [train flags]
                                  run an N-process job on this machine
  qvd status PEER|RUN_DIR         list a cluster's members, or a run's re-forms
  qvd bench COLLECTIVE --nproc N  measure allreduce|reducescatter|allgather|broadcast (algbw/busbw, #wrong, as nccl-tests)
  qvd gpus [--json] [--require]   list the GPUs NVML sees: memory, utilisation, driver, CUDA
  qvd keygen                      print a new cluster key
  qvd certs --out DIR --hosts H1,H2,...
                                  make a cluster CA and node certificates for mutual TLS
  qvd estimate --params N | -c CONFIG [--world N] [--stage S] [--offload cpu]
                                  per-rank memory of ZeRO stages 0-2; --recommend a micro-batch
                                  and accumulation for --memory and --effective-batch
  qvd plot METRICS [-o PNG]       plot a run's metrics.jsonl (or its run directory) to a PNG
  qvd eval -c CONFIG --checkpoint PATH
                                  test-set accuracy, loss and confusion matrix of trained weights
  qvd predict -c CONFIG --checkpoint PATH IMAGE...
                                  top-k classes of PNG/JPEG images
  qvd dashboard RUN_DIR [--addr HOST:PORT]
                                  serve a live web page of a run's curves, memory and events
  qvd config [-c CONFIG] [flags]  print the resolved configuration as YAML
  qvd completion bash|zsh         print a shell completion script
  qvd version                     print the version
  qvd help [COMMAND]              print this overview, or a command's help

Run "qvd help COMMAND" (or "qvd COMMAND --help") for a command's flags and examples.
`

func main() { os.Exit(mainWithSignals()) }

// mainWithSignals runs the command line with SIGINT/SIGTERM/SIGUSR1 cancelling the context, so
// a training job stops at a step boundary and saves a checkpoint. The context's cause is an
// interrupted naming the signal, so errors say "interrupted by SIGTERM" rather than "context
// canceled"; a command it stops exits 128+signal, as a shell reports a process the signal
// killed (130 for SIGINT, 143 for SIGTERM, exitPreempted 138 for SIGUSR1).
func mainWithSignals() int {
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM, syscall.SIGUSR1)
	defer signal.Stop(sigs)
	go func() {
		select {
		case s := <-sigs:
			sig, _ := s.(syscall.Signal)
			cancel(interrupted{sig})
		case <-ctx.Done():
		}
	}()
	return signalExitCode(ctx, run(ctx, os.Args[1:], os.Stdout, os.Stderr))
}

// interrupted is the cause of the context's cancellation by a signal. It is a
// context.Canceled, so code that tests for cancellation still sees one.
type interrupted struct{ sig syscall.Signal }

func (e interrupted) Error() string { return "interrupted by " + launch.SignalName(e.sig) }

func (e interrupted) Is(target error) bool { return target == context.Canceled }

// signalExitCode is code, or 128+signal when a signal stopped the command (a command that
// still succeeded keeps 0).
func signalExitCode(ctx context.Context, code int) int {
	var in interrupted
	if code != exitOK && errors.As(context.Cause(ctx), &in) {
		return 128 + int(in.sig)
	}
	return code
}

// run is main without the process: tests call it directly.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	name := args[0]
	switch name {
	case "--version", "-version":
		name = "version"
	case "-h", "-help", "--help":
		name = "help"
	}
	c, ok := lookupCommand(name)
	if !ok {
		fmt.Fprintf(stderr, "qvd: unknown command %q (see qvd help)\n", args[0])
		return exitUsage
	}
	if c.Flagless && cli.IsHelpArg(args[1:]) {
		return commandHelp(c, stdout, stderr)
	}
	return c.run(ctx, args[1:], stdout, stderr)
}
