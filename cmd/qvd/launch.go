package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/qvd/qvd/launch"
)

// launchedEnv is set in the environment of qvd launch's workers: the launcher, not its rank 0,
// prints the command that resumes an interrupted run.
const launchedEnv = launch.LaunchedEnv

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
func cmdLaunch(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("launch")
	nproc := fs.Int("nproc", 2, "number of local workers")
	keyFile := fs.String("cluster-key-file", "", "cluster key file (default: a fresh random key for this launch)")
	var nf nodeFlags
	nf.register(fs)
	var tf tlsFlags
	tf.register(fs)
	// launch's own flags come first; everything from the first flag it does not know is
	// passed to the coordinator's `qvd train`.
	own, rest := splitLaunchArgs(args)
	if code, ok := parseFlags(fs, own, stdout, stderr); !ok {
		return code
	}
	if *nproc < 1 || *nproc > 256 {
		fmt.Fprintf(stderr, "qvd launch: --nproc must be in [1, 256], got %d\n", *nproc)
		return exitUsage
	}
	if err := nf.Validate(*keyFile != "" || os.Getenv(clusterKeyEnv) != ""); err != nil {
		fmt.Fprintf(stderr, "qvd launch: %v\n", err)
		return exitUsage
	}
	exe, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "qvd launch: locating the qvd binary: %v\n", err)
		return exitFailure
	}
	t := launch.Train{Exe: exe, NProc: *nproc, Args: rest}
	var code int
	if t.Env, t.Place, code = nf.prepare(ctx, fs, "qvd launch", *keyFile, *nproc, stderr); code != exitOK {
		return code
	}
	if *keyFile != "" {
		t.Common = append(t.Common, "--cluster-key-file", *keyFile)
	}
	// Every local worker uses the same certificate (one host); QVD_TLS_* pass through the
	// environment.
	t.Common, t.Nodes = append(t.Common, tf.args()...), nf.Nodes
	code = launchExit(launch.Run(ctx, t.Workers(), stdout, stderr))
	if code == exitInterrupted {
		fmt.Fprintf(stdout, "resume with: %s\n", resumeCommand(progName()+" launch", args))
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

// splitLaunchArgs separates launch's own flags from the train flags after them.
func splitLaunchArgs(args []string) (own, rest []string) {
	takes := map[string]bool{"nproc": true, "cluster-key-file": true, "host": true, "tls-ca": true, "tls-cert": true, "tls-key": true,
		"nnodes": true, "node-rank": true, "master-addr": true, "master-port": true}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name := strings.TrimLeft(a, "-")
		if eq := strings.IndexByte(name, '='); eq >= 0 {
			name = name[:eq]
			if takes[name] {
				own = append(own, a)
				continue
			}
		} else if takes[name] && strings.HasPrefix(a, "-") {
			own = append(own, a)
			if i+1 < len(args) {
				own = append(own, args[i+1])
				i++
			}
			continue
		}
		if name == "h" || name == "help" {
			own = append(own, a)
			continue
		}
		return own, args[i:]
	}
	return own, nil
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

// prepare readies a launch of nproc local workers under cmd's name, once the flags are
// valid: the workers' environment (a fresh cluster key unless keyFile or the environment has
// one; their share of the cores) and where they meet. A non-OK code comes with its message
// written to stderr.
func (nf *nodeFlags) prepare(ctx context.Context, fs *flag.FlagSet, cmd, keyFile string, nproc int, stderr io.Writer) (env []string, p launch.Placement, code int) {
	env = os.Environ()
	if keyFile == "" && os.Getenv(clusterKeyEnv) == "" {
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			fmt.Fprintf(stderr, "%s: generating a cluster key: %v\n", cmd, err)
			return nil, p, exitFailure
		}
		// Passed in the environment, not on the command line, so it does not show in ps.
		env = append(env, clusterKeyEnv+"="+hex.EncodeToString(key))
	}
	env = launch.ShareCores(env, os.Getenv, nproc)
	fs.Visit(func(f *flag.Flag) { nf.HostSet = nf.HostSet || f.Name == "host" })
	p, err := nf.Place(ctx)
	if err != nil {
		fmt.Fprintf(stderr, "%s: %v\n", cmd, err)
		if errors.Is(err, launch.ErrMasterAddr) {
			return nil, p, exitUsage
		}
		return nil, p, exitFailure
	}
	return env, p, exitOK
}
