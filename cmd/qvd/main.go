// Command qvd is the qvd trainer: `qvd train` runs a training job on this machine, `qvd plot`
// turns a run's metrics into a PNG. It only wires flags to the library packages.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/qvd/qvd/internal/version"
)

// Exit codes.
const (
	exitOK          = 0
	exitFailure     = 1
	exitUsage       = 2   // bad flags or configuration
	exitInterrupted = 130 // stopped by SIGINT/SIGTERM after saving a checkpoint (128+SIGINT, as shells report)
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
  qvd status PEER                 list a cluster's members
  qvd bench allreduce --nproc N   measure all-reduce bandwidth (algbw/busbw, as nccl-tests)
  qvd gpus [--json] [--require]   list the GPUs NVML sees: memory, utilisation, driver, CUDA
  qvd keygen                      print a new cluster key
  qvd certs --out DIR --hosts H1,H2,...
                                  make a cluster CA and node certificates for mutual TLS
  qvd estimate --params N | -c CONFIG [--world N] [--stage S] [--offload cpu]
                                  per-rank memory of ZeRO stages 0-2; --recommend a micro-batch
                                  and accumulation for --memory and --effective-batch
  qvd plot METRICS [-o PNG]       plot a run's metrics.jsonl (or its run directory) to a PNG
  qvd config [-c CONFIG] [flags]  print the resolved configuration as YAML
  qvd version                     print the version

Run "qvd COMMAND -h" for a command's flags.
`

func main() { os.Exit(mainWithSignals()) }

// mainWithSignals runs the command line with SIGINT/SIGTERM cancelling the context, so a
// training job stops at a step boundary and saves a checkpoint.
func mainWithSignals() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return run(ctx, os.Args[1:], os.Stdout, os.Stderr)
}

// run is main without the process: tests call it directly.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, usage)
		return exitUsage
	}
	switch args[0] {
	case "train":
		return cmdTrain(ctx, args[1:], stdout, stderr)
	case "join":
		return cmdJoin(ctx, args[1:], stdout, stderr)
	case "launch":
		return cmdLaunch(ctx, args[1:], stdout, stderr)
	case "status":
		return cmdStatus(ctx, args[1:], stdout, stderr)
	case "bench":
		return cmdBench(ctx, args[1:], stdout, stderr)
	case "gpus":
		return cmdGPUs(args[1:], stdout, stderr)
	case "keygen":
		return cmdKeygen(args[1:], stdout, stderr)
	case "certs":
		return cmdCerts(args[1:], stdout, stderr)
	case "plot":
		return cmdPlot(args[1:], stdout, stderr)
	case "estimate":
		return cmdEstimate(args[1:], stdout, stderr)
	case "config":
		return cmdConfig(args[1:], stdout, stderr)
	case "version", "--version", "-version":
		fmt.Fprintf(stdout, "qvd %s\n", version.Version)
		return exitOK
	case "help", "-h", "--help":
		fmt.Fprint(stdout, usage)
		return exitOK
	default:
		fmt.Fprintf(stderr, "qvd: unknown command %q\n\n%s", args[0], usage)
		return exitUsage
	}
}

// parseOneArg parses a command's flags around its one positional argument (PEER, a path),
// which may come before or after them; it prints the usage and reports false otherwise.
func parseOneArg(fs *flag.FlagSet, args []string) (string, bool) {
	var arg string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		arg, args = args[0], args[1:]
	}
	if err := fs.Parse(args); err != nil {
		return "", false
	}
	if arg == "" && fs.NArg() == 1 {
		arg = fs.Arg(0)
	} else if arg == "" || fs.NArg() > 0 {
		fs.Usage()
		return "", false
	}
	return arg, true
}
