package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"runtime"

	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/internal/blas"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

// envTrain is cmdTrain's hook for jobs that a launcher's environment describes: torchrun's
// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else a SLURM step's (launch.FromEnv).
// The coordinator gets --nodes, its bind address and node name (unless flags gave them) and
// returns handled=false so cmdTrain goes on; any other process runs as a `qvd join` worker and
// returns its exit code with handled=true. Outside such a job, or with --nodes given, it
// changes nothing.
func envTrain(ctx context.Context, f *runFlags, nodes *int, mf *memberFlags, o outputFlags, stdout, stderr io.Writer) (code int, handled bool) {
	set := setFlags(f)
	if set["nodes"] {
		return exitOK, false
	}
	hostname, _ := os.Hostname()
	t, ok, err := launch.FromEnv(ctx, launch.Env{Getenv: os.Getenv, Hostname: hostname, NumCPU: runtime.NumCPU(),
		Bind: mf.bind, BindSet: set["bind"], NodeName: mf.nodeName, NodeNameSet: set["node-name"]})
	if err != nil {
		fmt.Fprintf(stderr, "qvd train: %v\n", err)
		return exitUsage, true
	}
	if !ok {
		return exitOK, false
	}
	boot, err := job.NewLogger(stderr, "", zapcore.InfoLevel)
	if err != nil {
		fmt.Fprintf(stderr, "qvd train: %v\n", err)
		return exitFailure, true
	}
	mf.bind, mf.nodeName = t.Bind, t.NodeName
	if t.Threads > 0 {
		// Processes sharing a machine share its cores, as qvd launch's workers do.
		runtime.GOMAXPROCS(t.Threads)
		blas.SetThreads(t.Threads)
	}
	t.Log(boot.Log)
	if t.Coordinator {
		*nodes = t.World
		return exitOK, false
	}
	// A worker's config comes from the coordinator; only --data is its own (a path on its
	// machine), as for `qvd join --data`.
	dataPath := ""
	if f.o.DataPath != nil {
		dataPath = *f.o.DataPath
	}
	return joinJob(ctx, t.Peer, o, *mf, dataPath, stdout, stderr), true
}

// setFlags is the set of flags given on the command line.
func setFlags(f *runFlags) map[string]bool {
	set := map[string]bool{}
	f.fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	return set
}
