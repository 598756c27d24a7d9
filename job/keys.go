package job

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
)

// Environment variables a node's key and TLS files may come from. The caller reads them
// (through MemberOptions.Getenv): a library never reads the process environment itself.
const (
	// ClusterKeyEnv may hold the cluster key when no key file is given.
	ClusterKeyEnv = "QVD_CLUSTER_KEY"
	// TLSCAEnv, TLSCertEnv and TLSKeyEnv may name this node's TLS files when the flags do not
	// (a worker's TLS never comes from the coordinator's config: the paths are the worker's own).
	TLSCAEnv   = "QVD_TLS_CA"
	TLSCertEnv = "QVD_TLS_CERT"
	TLSKeyEnv  = "QVD_TLS_KEY"
)

// LoadClusterKey reads the cluster key from file, or else from $QVD_CLUSTER_KEY as getenv
// (nil: an empty environment) reports it. The text may be hex or base64 of 16, 24 or 32
// bytes (AES-128/192/256), or those raw bytes; a weak key is refused (cluster.ValidateKey).
// log, when not nil, is warned about a key file group or others may read.
func LoadClusterKey(file string, getenv func(string) string, log *zap.Logger) ([]byte, error) {
	var text []byte
	src := "$" + ClusterKeyEnv
	if file != "" {
		b, err := cluster.ReadKeyFile(file, log)
		if err != nil {
			return nil, fmt.Errorf("cluster key: %w", err)
		}
		text, src = b, file
	} else if v := env(getenv)(ClusterKeyEnv); v != "" {
		text = []byte(v)
	} else {
		return nil, fmt.Errorf("cluster key: none given: use --cluster-key-file FILE or set %s (make one with `qvd keygen`)", ClusterKeyEnv)
	}
	key, err := parseKey(text)
	if err == nil {
		err = cluster.ValidateKey(key)
	}
	if err != nil {
		return nil, fmt.Errorf("cluster key from %s: %w", src, err)
	}
	return key, nil
}

func parseKey(text []byte) ([]byte, error) {
	okLen := func(b []byte) bool { return len(b) == 16 || len(b) == 24 || len(b) == 32 }
	t := bytes.TrimSpace(text)
	if b, err := hex.DecodeString(string(t)); err == nil && okLen(b) {
		return b, nil
	}
	if b, err := base64.StdEncoding.DecodeString(string(t)); err == nil && okLen(b) {
		return b, nil
	}
	if okLen(text) {
		return text, nil
	}
	return nil, errors.New("want 16, 24 or 32 bytes, as hex, base64 or raw (make one with `qvd keygen`)")
}

// ResolveTLS picks this node's TLS files by qvd's one precedence rule — flags, then the
// environment, then the config, then none: flags if any is given, else QVD_TLS_* if any is
// set, else the config's tls section (fromConfig; empty for a worker). The three files come
// from one source, never mixed, so a half-set source fails validation instead of borrowing
// the rest from another.
func ResolveTLS(flags cluster.TLSConfig, getenv func(string) string, fromConfig cluster.TLSConfig) cluster.TLSConfig {
	if flags != (cluster.TLSConfig{}) {
		return flags
	}
	getenv = env(getenv)
	if e := (cluster.TLSConfig{CA: getenv(TLSCAEnv), Cert: getenv(TLSCertEnv), Key: getenv(TLSKeyEnv)}); e != (cluster.TLSConfig{}) {
		return e
	}
	return fromConfig
}

// LoadTLS resolves (ResolveTLS) and loads this node's TLS identity: the files it chose, and
// nil without TLS. log, when not nil, is warned about a key file others may read.
func LoadTLS(flags cluster.TLSConfig, getenv func(string) string, fromConfig cluster.TLSConfig, log *zap.Logger) (cluster.TLSConfig, *cluster.TLS, error) {
	files := ResolveTLS(flags, getenv, fromConfig)
	id, err := files.Load(log)
	if err != nil {
		return files, nil, fmt.Errorf("tls.%w", err)
	}
	return files, id, nil
}

// env is getenv, or an empty environment for nil.
func env(getenv func(string) string) func(string) string {
	if getenv == nil {
		return func(string) string { return "" }
	}
	return getenv
}
