package main

import (
	"flag"
	"io"
	"os"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/job"
)

// Environment variables that may hold the cluster key and name this node's TLS files.
const (
	clusterKeyEnv = job.ClusterKeyEnv
	tlsCAEnv      = job.TLSCAEnv
	tlsCertEnv    = job.TLSCertEnv
	tlsKeyEnv     = job.TLSKeyEnv
)

// loadClusterKey reads the cluster key from file, or else from $QVD_CLUSTER_KEY
// (job.LoadClusterKey).
func loadClusterKey(file string) ([]byte, error) { return job.LoadClusterKey(file, os.Getenv, nil) }

// memberFlags are the per-node settings of `train --nodes` and `join`.
type memberFlags struct {
	bind, grpcBind, advertise, nodeName, keyFile string
	tls                                          tlsFlags
}

// options are the job.MemberOptions these flags give, reading the environment for the key
// and TLS files they do not name.
func (mf memberFlags) options() job.MemberOptions {
	return job.MemberOptions{Bind: mf.bind, GRPCBind: mf.grpcBind, Advertise: mf.advertise, NodeName: mf.nodeName,
		KeyFile: mf.keyFile, TLS: mf.tls.files(), Getenv: os.Getenv}
}

// tlsFlags are --tls-ca, --tls-cert and --tls-key.
type tlsFlags struct{ ca, cert, key string }

func (t *tlsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&t.ca, "tls-ca", "", "cluster CA certificate (PEM) for mutual TLS between nodes; with --tls-cert and --tls-key (default: $"+tlsCAEnv+", else the config's tls.ca; make them with qvd certs)")
	fs.StringVar(&t.cert, "tls-cert", "", "this node's certificate (PEM), signed by --tls-ca (default: $"+tlsCertEnv+", else tls.cert)")
	fs.StringVar(&t.key, "tls-key", "", "this node's private key (PEM) (default: $"+tlsKeyEnv+", else tls.key)")
}

func (t tlsFlags) files() cluster.TLSConfig {
	return cluster.TLSConfig{CA: t.ca, Cert: t.cert, Key: t.key}
}

// args returns the flags again, for a child process.
func (t tlsFlags) args() []string {
	var a []string
	for _, f := range []struct{ name, v string }{{"--tls-ca", t.ca}, {"--tls-cert", t.cert}, {"--tls-key", t.key}} {
		if f.v != "" {
			a = append(a, f.name, f.v)
		}
	}
	return a
}

// resolveTLS picks this node's TLS files: flags, then the environment, then the config
// (job.ResolveTLS).
func resolveTLS(t tlsFlags, getenv func(string) string, fromConfig cluster.TLSConfig) cluster.TLSConfig {
	return job.ResolveTLS(t.files(), getenv, fromConfig)
}

// load resolves and loads this node's TLS identity; nil without TLS (job.LoadTLS).
func (t tlsFlags) load(fromConfig cluster.TLSConfig) (cluster.TLSConfig, *cluster.TLS, error) {
	return job.LoadTLS(t.files(), os.Getenv, fromConfig, nil)
}

// logger and newLogger keep torchrun.go's boot log building until it calls job.NewLogger.
type logger struct {
	log   *zap.Logger
	close func()
	err   func() error
}

func newLogger(w io.Writer, path string, level zapcore.Level) (logger, error) {
	l, err := job.NewLogger(w, path, level)
	return logger{l.Log, l.Close, l.Err}, err
}
