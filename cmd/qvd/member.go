package main

import (
	"flag"
	"os"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/job"
)

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

func (mf *memberFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&mf.bind, "bind", "", "gossip address host:port of this node (default cluster.bind, 0.0.0.0:7946); gRPC listens on port+1")
	fs.StringVar(&mf.grpcBind, "grpc-bind", "", "gRPC address host:port (default: the --bind host, gossip port + 1; port 0 picks a free one)")
	fs.StringVar(&mf.advertise, "advertise", "", "address other nodes should use to reach this one (default: derived from --bind)")
	fs.StringVar(&mf.nodeName, "node-name", "", "this node's unique name (default: hostname and a random suffix)")
	fs.StringVar(&mf.keyFile, "cluster-key-file", "", "file holding the cluster key (default: $"+job.ClusterKeyEnv+")")
	mf.tls.register(fs)
}

// tlsFlags are --tls-ca, --tls-cert and --tls-key.
type tlsFlags struct{ ca, cert, key string }

func (t *tlsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&t.ca, "tls-ca", "", "cluster CA certificate (PEM) for mutual TLS between nodes; with --tls-cert and --tls-key (default: $"+job.TLSCAEnv+", else the config's tls.ca; make them with qvd certs)")
	fs.StringVar(&t.cert, "tls-cert", "", "this node's certificate (PEM), signed by --tls-ca (default: $"+job.TLSCertEnv+", else tls.cert)")
	fs.StringVar(&t.key, "tls-key", "", "this node's private key (PEM) (default: $"+job.TLSKeyEnv+", else tls.key)")
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
