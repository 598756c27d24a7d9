package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/configs"
)

// cmdStatus joins the cluster through PEER as an observer and prints its members.
func cmdStatus(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("status")
	keyFile := fs.String("cluster-key-file", "", "file holding the cluster key (default: $"+clusterKeyEnv+")")
	var tf tlsFlags
	tf.register(fs)
	bind := fs.String("bind", "0.0.0.0:0", "gossip address of this observer")
	timeout := fs.Duration("timeout", 10*time.Second, "give up after this long")
	peer, code, ok := parseOneArg(fs, args, stdout, stderr)
	if !ok {
		return code
	}
	key, err := loadClusterKey(*keyFile)
	if err != nil {
		fmt.Fprintf(stderr, "qvd status: %v\n", err)
		return exitUsage
	}
	// The observer talks gossip only, but a cluster with TLS refuses members that do not
	// show its CA (see cluster.ErrTLSMismatch), so it needs the same --tls-* files.
	_, id, err := tf.load(cluster.TLSConfig{})
	if err != nil {
		fmt.Fprintf(stderr, "qvd status: %v\n", err)
		return exitUsage
	}
	cfg := configs.Default().Cluster
	cfg.Key, cfg.Bind, cfg.TLS = key, *bind, id
	var b [3]byte
	_, _ = rand.Read(b[:])
	cfg.NodeName = "status-" + hex.EncodeToString(b[:])
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	members, err := cluster.Status(ctx, cfg, peer, zap.NewNop())
	if err != nil {
		fmt.Fprintf(stderr, "qvd status: %v\n", err)
		return exitFailure
	}
	if err := cluster.FormatStatus(stdout, members); err != nil {
		fmt.Fprintf(stderr, "qvd status: %v\n", err)
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
