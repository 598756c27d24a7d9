package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/qvd/qvd/internal/cli"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

// cmdLaunch starts N local workers on 127.0.0.1 — the first as the coordinator
// (`qvd train ... --nodes N --bind`), the others with `qvd join` — prefixes their output with
// the rank, forwards Ctrl-C/SIGTERM to all of them, and exits non-zero with the first failing
// worker's error. Like torchrun's standalone mode, but rendezvous goes through the same gossip
// cluster a multi-machine job uses.
//
// With --nnodes M > 1 it is one of M launchers, one per machine, as torchrun's static
// rendezvous (--nnodes, --node-rank, --master-addr, --master-port): launcher R starts its N
// workers as global ranks R·N … R·N+N-1; node 0's first worker coordinates the M·N processes
// at MASTER_ADDR:MASTER_PORT and every other worker joins there, binding the address that
// routes to MASTER_ADDR (or --host) at free ports. Node names launch-<global rank> make the
// ranks come out in that order. The launchers must share a cluster key (the key env or
// --cluster-key-file); the train flags count on node 0 only (others take --data alone).
//
// --min-nodes M makes the job elastic (the survivors of a failed worker go on while M live);
// --max-restarts K also starts a failed local worker again, up to K times per launch, as a
// `qvd join` through a live local worker under the same name and address, which the running
// job admits at a step boundary.
func cmdLaunch(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("launch")
	nproc := fs.Int("nproc", 2, "number of local workers")
	keyFile := fs.String("cluster-key-file", "", "cluster key file (default: a fresh random key for this launch)")
	minNodes := fs.Int("min-nodes", 0, "elastic training: the job keeps training while at least this many workers live (0: a failed worker stops the job)")
	maxRestarts := fs.Int("max-restarts", 0, "with --min-nodes: restart a local worker that fails while the job runs, as a worker that joins the job, up to this many times in all (torchrun's --max-restarts)")
	var nf nodeFlags
	nf.register(fs)
	var tf tlsFlags
	tf.register(fs)
	// launch's own flags come first; everything from the first flag it does not know is
	// passed to the coordinator's `qvd train`.
	own, rest := cli.SplitKnown(fs, args)
	if code, ok := parseFlags(fs, own, stdout, stderr); !ok {
		return code
	}
	if *nproc < 1 || *nproc > 256 {
		fmt.Fprintf(stderr, "qvd launch: --nproc must be in [1, 256], got %d\n", *nproc)
		return exitUsage
	}
	if err := nf.Validate(*keyFile != "" || os.Getenv(job.ClusterKeyEnv) != ""); err != nil {
		fmt.Fprintf(stderr, "qvd launch: %v\n", err)
		return exitUsage
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "qvd launch: locating the qvd binary: %v\n", err)
		return exitFailure
	}
	if *minNodes < 0 || *minNodes > *nproc*nf.NNodes {
		fmt.Fprintf(stderr, "qvd launch: --min-nodes must be in [0, %d] (the job's workers), got %d\n", *nproc*nf.NNodes, *minNodes)
		return exitUsage
	}
	t := launch.Train{Exe: exe, NProc: *nproc, Args: rest, MinNodes: *minNodes, MaxRestarts: *maxRestarts}
	if err := t.Elastic().Validate(); err != nil {
		fmt.Fprintf(stderr, "qvd launch: %v\n", err)
		return exitUsage
	}
	var code int
	if t.Env, t.Place, code = nf.prepare(ctx, fs, "qvd launch", *keyFile, *nproc, stderr); code != exitOK {
		return code
	}
	if t.MaxRestarts > 0 {
		if err := t.PinBinds(); err != nil {
			fmt.Fprintf(stderr, "qvd launch: %v\n", err)
			return exitFailure
		}
	}
	if *keyFile != "" {
		t.Common = append(t.Common, "--cluster-key-file", *keyFile)
	}
	// Every local worker uses the same certificate (one host); QVD_TLS_* pass through the
	// environment.
	t.Common, t.Nodes = append(t.Common, tf.args()...), nf.Nodes
	code = launchExit(launch.RunElastic(ctx, t.Workers(), t.Elastic(), stdout, stderr))
	if code == exitInterrupted {
		fmt.Fprintf(stdout, "resume with: %s\n", launch.ResumeCommand(progName()+" launch", args))
	}
	return code
}

// launchExit is the exit code for how launch.Run ended (it has reported why).
func launchExit(err error) int {
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, launch.ErrInterrupted):
		return exitInterrupted
	}
	return exitFailure
}

// nodeFlags are the multi-machine flags of launch and bench, as torchrun's static rendezvous.
type nodeFlags struct{ launch.Nodes }

func (nf *nodeFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&nf.Host, "host", "127.0.0.1", "address the workers bind and talk on (default 127.0.0.1; with --nnodes > 1, the address that routes to --master-addr)")
	fs.IntVar(&nf.NNodes, "nnodes", 1, "number of machines, one launcher each (torchrun's --nnodes)")
	fs.IntVar(&nf.NodeRank, "node-rank", 0, "this launcher's machine in [0, nnodes): its workers are ranks node-rank·nproc and up")
	fs.StringVar(&nf.MasterAddr, "master-addr", "", "host of node 0, where its first worker coordinates (required with --nnodes > 1)")
	fs.IntVar(&nf.MasterPort, "master-port", 0, "the coordinator's gossip port, gRPC on the next (default: 29500 with --nnodes > 1, else a free port)")
}

// prepare readies a launch of nproc local workers under cmd's name once the flags are
// valid (launch.Nodes.Prepare). A non-OK code comes with its message written to stderr.
func (nf *nodeFlags) prepare(ctx context.Context, fs *flag.FlagSet, cmd, keyFile string, nproc int, stderr io.Writer) ([]string, launch.Placement, int) {
	fs.Visit(func(f *flag.Flag) { nf.HostSet = nf.HostSet || f.Name == "host" })
	env, p, err := nf.Prepare(ctx, keyFile, job.ClusterKeyEnv, nproc, os.Environ(), os.Getenv)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", cmd, err)
		if errors.Is(err, launch.ErrMasterAddr) {
			return nil, p, exitUsage
		}
		return nil, p, exitFailure
	}
	return env, p, exitOK
}
