package main

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/qvd/qvd/internal/pki"
)

// certValidity is how long `qvd certs` makes certificates last by default: long enough for a
// test cluster, short enough that a forgotten one expires.
const certValidity = 365 * 24 * time.Hour

// cmdCerts makes a private CA and one certificate per host for a cluster's mutual TLS:
// ca.pem, ca-key.pem, HOST.pem and HOST-key.pem in --out. With an existing ca.pem and
// ca-key.pem in --out it issues certificates for more hosts from that CA. It never overwrites
// a file.
func cmdCerts(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("certs")
	out := fs.String("out", "", "directory for the files (created if missing)")
	hosts := fs.String("hosts", "", "comma-separated host names or IP addresses, one certificate each (a host may list aliases joined by '+', e.g. node1+10.0.0.5)")
	validity := fs.Duration("validity", certValidity, "how long the certificates are valid")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		return usageError(fs, stderr, "unexpected argument %q", fs.Arg(0))
	}
	if *out == "" || *hosts == "" {
		return usageError(fs, stderr, "--out DIR and --hosts H1,H2,... are required")
	}
	if *validity < time.Hour {
		fmt.Fprintf(stderr, "qvd certs: --validity must be at least 1h, got %v\n", *validity)
		return exitUsage
	}
	var nodes [][]string
	for _, h := range strings.Split(*hosts, ",") {
		names := strings.Split(strings.TrimSpace(h), "+")
		for _, n := range names {
			if n == "" || strings.ContainsAny(n, `/\ `) {
				fmt.Fprintf(stderr, "qvd certs: --hosts: bad host %q\n", h)
				return exitUsage
			}
		}
		nodes = append(nodes, names)
	}
	if err := writeCerts(*out, nodes, *validity, time.Now(), stdout); err != nil {
		fmt.Fprintf(stderr, "qvd certs: %v\n", err)
		return exitFailure
	}
	return exitOK
}

// writeCerts makes the files; it checks that none of them exists before writing any.
func writeCerts(dir string, nodes [][]string, validity time.Duration, now time.Time, stdout io.Writer) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	caCert, caKey := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	var ca *pki.CA
	certPEM, err1 := os.ReadFile(caCert)
	keyPEM, err2 := os.ReadFile(caKey)
	switch {
	case err1 == nil && err2 == nil:
		var err error
		if ca, err = pki.LoadCA(certPEM, keyPEM); err != nil {
			return fmt.Errorf("existing CA in %s: %w", dir, err)
		}
		fmt.Fprintf(stdout, "using the existing CA %s\n", caCert)
	case errors.Is(err1, fs.ErrNotExist) && errors.Is(err2, fs.ErrNotExist):
	default:
		return fmt.Errorf("%s needs both ca.pem and ca-key.pem, or neither (%v; %v)", dir, err1, err2)
	}

	type file struct {
		path string
		data []byte
		mode os.FileMode
	}
	var files []file
	if ca == nil {
		var err error
		if ca, err = pki.NewCA(validity, now); err != nil {
			return err
		}
		files = append(files, file{caCert, ca.CertPEM, 0o644}, file{caKey, ca.KeyPEM, 0o600})
	}
	for _, names := range nodes {
		cert, key, err := ca.Issue(names, validity, now)
		if err != nil {
			return err
		}
		base := strings.ReplaceAll(names[0], ":", "_") // IPv6 literals in file names
		files = append(files, file{filepath.Join(dir, base+".pem"), cert, 0o644}, file{filepath.Join(dir, base+"-key.pem"), key, 0o600})
	}
	for _, f := range files {
		if _, err := os.Lstat(f.path); err == nil {
			return fmt.Errorf("%s exists; not overwriting it (remove it, or use another --out)", f.path)
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	for _, f := range files {
		// O_EXCL: a file that appeared since the check is still not overwritten.
		w, err := os.OpenFile(f.path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, f.mode)
		if err != nil {
			return err
		}
		_, err = w.Write(f.data)
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("writing %s: %w", f.path, err)
		}
		fmt.Fprintf(stdout, "wrote %s\n", f.path)
	}
	fmt.Fprintf(stdout, "keep %s offline (it can make members); give each host ca.pem and its own cert and key\n", caKey)
	return nil
}
