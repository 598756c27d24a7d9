package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/job"
)

// cmdStatus joins the cluster through PEER as an observer and prints its members, or, given a
// run directory, prints the job's generation, world and re-forms from its metrics.
func cmdStatus(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("status")
	keyFile := fs.String("cluster-key-file", "", "file holding the cluster key (default: $"+job.ClusterKeyEnv+")")
	var tf tlsFlags
	tf.register(fs)
	bind := fs.String("bind", "0.0.0.0:0", "gossip address of this observer")
	timeout := fs.Duration("timeout", 10*time.Second, "give up after this long")
	peer, code, ok := parseOneArg(fs, args, stdout, stderr)
	if !ok {
		return code
	}
	// A run directory (or its metrics.jsonl): the job's generation, world and re-forms.
	if path, isRun := job.RunStatusPath(peer); isRun {
		s, err := job.ReadRunStatus(path)
		if err == nil {
			err = job.FormatRunStatus(stdout, s, time.Local)
		}
		if err != nil {
			fmt.Fprintf(stderr, "qvd status: %v\n", err)
			return exitFailure
		}
		return exitOK
	}
	// The observer talks gossip only, but a cluster with TLS refuses members that do not
	// show its CA (see cluster.ErrTLSMismatch), so it needs the same --tls-* files.
	members, err := job.Status(ctx, peer, job.ObserverOptions{Bind: *bind, KeyFile: *keyFile, TLS: tf.files(), Getenv: os.Getenv, Timeout: *timeout})
	if err == nil {
		err = cluster.FormatStatus(stdout, members)
	}
	if err != nil {
		fmt.Fprintf(stderr, "qvd status: %v\n", err)
		if errors.Is(err, configs.ErrInvalid) {
			return exitUsage
		}
		return exitFailure
	}
	return exitOK
}

// cmdKeygen prints a fresh random 32-byte cluster key in hex.
func cmdKeygen(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		fmt.Fprintln(stderr, "Usage: qvd keygen > cluster.key")
		return exitUsage
	}
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		fmt.Fprintf(stderr, "qvd keygen: %v\n", err)
		return exitFailure
	}
	fmt.Fprintln(stdout, hex.EncodeToString(key))
	return exitOK
}
