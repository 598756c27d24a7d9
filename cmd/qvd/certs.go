package main

import (
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"time"

	"github.com/qvd/qvd/internal/pki"
)

// certValidity is how long `qvd certs` makes certificates last by default: long enough for a
// test cluster, short enough that a forgotten one expires.
const certValidity = 365 * 24 * time.Hour

// cmdCerts makes a private CA and one certificate per host for a cluster's mutual TLS
// (pki.WriteDir): ca.pem, ca-key.pem, HOST.pem and HOST-key.pem in --out, from the CA already
// there if any. It never overwrites a file.
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
	if err := pki.WriteDir(*out, nodes, *validity, time.Now(), func(s string) { fmt.Fprintln(stdout, s) }); err != nil {
		fmt.Fprintf(stderr, "qvd certs: %v\n", err)
		return exitFailure
	}
	fmt.Fprintf(stdout, "keep %s offline (it can make members); give each host ca.pem and its own cert and key\n", filepath.Join(*out, "ca-key.pem"))
	return exitOK
}
