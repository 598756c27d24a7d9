package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/launch"
)

// certsFor runs `qvd certs` into a fresh directory and returns it.
func certsFor(t *testing.T, hosts string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "certs")
	if code, out, errs := runQVD(t, "certs", "--out", dir, "--hosts", hosts); code != exitOK {
		t.Fatalf("qvd certs: exit %d\n%s\n%s", code, out, errs)
	}
	return dir
}

// tlsArgs are the --tls-* flags for host's files in dir.
func tlsArgs(dir, host string) []string {
	return []string{"--tls-ca", filepath.Join(dir, "ca.pem"), "--tls-cert", filepath.Join(dir, host+".pem"),
		"--tls-key", filepath.Join(dir, host+"-key.pem")}
}

// TestCertsCommand: qvd certs writes a CA and a certificate per host, keys 0600, never
// overwrites a file, and adds hosts to an existing CA; what it writes loads.
func TestCertsCommand(t *testing.T) {
	dir := certsFor(t, "127.0.0.1,node2+10.0.0.2")
	for name, mode := range map[string]os.FileMode{"ca.pem": 0o644, "ca-key.pem": 0o600, "127.0.0.1.pem": 0o644,
		"127.0.0.1-key.pem": 0o600, "node2.pem": 0o644, "node2-key.pem": 0o600} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != mode {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode().Perm(), mode)
		}
	}
	ca, _ := os.ReadFile(filepath.Join(dir, "ca.pem"))
	code, _, errs := runQVD(t, "certs", "--out", dir, "--hosts", "node2")
	if code == exitOK || !strings.Contains(errs, "not overwriting") {
		t.Fatalf("overwrite: exit %d: %s", code, errs)
	}
	if code, _, errs := runQVD(t, "certs", "--out", dir, "--hosts", "node3"); code != exitOK {
		t.Fatalf("adding a host: exit %d: %s", code, errs)
	}
	if again, _ := os.ReadFile(filepath.Join(dir, "ca.pem")); string(again) != string(ca) {
		t.Fatal("adding a host changed the CA")
	}
	for _, host := range []string{"127.0.0.1", "node2", "node3"} {
		a := tlsArgs(dir, host)
		f := cluster.TLSConfig{CA: a[1], Cert: a[3], Key: a[5]}
		if _, id, err := job.LoadTLS(f, os.Getenv, cluster.TLSConfig{}, nil); err != nil || id == nil {
			t.Fatalf("%s: loading the files: %v", host, err)
		}
	}
}

// TestTLSLaunch: a 2-process job with the certificates of `qvd certs` trains over mutual TLS
// on either data path; with a CA that did not sign the certificate, it fails at start and
// says which file is wrong.
func TestTLSLaunch(t *testing.T) {
	needDataset(t)
	t.Setenv(asQVD, "1")
	dir := certsFor(t, "127.0.0.1")
	other := certsFor(t, "127.0.0.1")
	common := []string{"--epochs", "1", "--train-subset", "512", "--test-subset", "128", "--quiet"}
	for _, transport := range []string{"tcp", "grpc"} {
		args := append([]string{"launch", "--nproc", "2"}, tlsArgs(dir, "127.0.0.1")...)
		args = append(args, append([]string{"--transport", transport, "--out", t.TempDir()}, common...)...)
		code, out, errs := runQVD(t, args...)
		if code != exitOK || !strings.Contains(out, "done:") {
			t.Fatalf("%s over mutual TLS: exit %d\n%s\n%s", transport, code, out, errs)
		}
		if !strings.Contains(errs, `"mutual_tls": true`) {
			t.Fatalf("%s: the members did not report mutual TLS:\n%s", transport, errs)
		}
	}

	wrongCA := filepath.Join(other, "ca.pem")
	args := []string{"launch", "--nproc", "2", "--tls-ca", wrongCA, "--tls-cert", filepath.Join(dir, "127.0.0.1.pem"),
		"--tls-key", filepath.Join(dir, "127.0.0.1-key.pem"), "--out", t.TempDir()}
	code, _, errs := runQVD(t, append(args, common...)...)
	if code == exitOK || !strings.Contains(errs, "tls.cert") || !strings.Contains(errs, "not valid under the CA in "+wrongCA) {
		t.Fatalf("mismatched CA: exit %d\n%s", code, errs)
	}
}

// TestTLSJoinRefused: against a coordinator with mutual TLS, a worker whose certificate
// another CA signed, or without TLS, is refused at join with an error that says so, and so
// is `qvd status` without the cluster's TLS files; with them, status lists the members.
func TestTLSJoinRefused(t *testing.T) {
	needDataset(t)
	dir := certsFor(t, "127.0.0.1")
	other := certsFor(t, "127.0.0.1")
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	args := append([]string{"train", "--nodes", "2", "--bind", coord, "--grpc-bind", "127.0.0.1:0", "--node-name", "c0",
		"--out", t.TempDir(), "--epochs", "1", "--quiet"}, tlsArgs(dir, "127.0.0.1")...)
	train, trainOut := qvdCmd(t, testKey, args...)
	if err := train.Start(); err != nil {
		t.Fatal(err)
	}
	defer func(c *exec.Cmd) { _ = c.Process.Signal(syscall.SIGTERM); _ = c.Wait() }(train)
	t.Setenv(job.ClusterKeyEnv, testKey)

	// Wait for the coordinator to answer gossip.
	statusArgs := append([]string{"status", coord}, tlsArgs(dir, "127.0.0.1")...)
	for deadline := time.Now().Add(30 * time.Second); ; {
		code, out, _ := runQVD(t, statusArgs...)
		if code == exitOK && strings.Contains(out, "c0") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("status with the cluster's certificate never listed the coordinator; coordinator:\n%s", trainOut)
		}
		time.Sleep(200 * time.Millisecond)
	}

	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"join, another CA", append([]string{"join", coord, "--bind", "127.0.0.1:0", "--node-name", "intruder"}, tlsArgs(other, "127.0.0.1")...),
			"this node uses mutual TLS with CA"},
		{"join, no TLS", []string{"join", coord, "--bind", "127.0.0.1:0", "--node-name", "plain"}, "this node uses no TLS"},
		{"status, no TLS", []string{"status", coord}, "this node uses no TLS"},
	} {
		code, _, errs := runQVD(t, c.args...)
		if code == exitOK || !strings.Contains(errs, "TLS setup mismatch") || !strings.Contains(errs, c.want) {
			t.Fatalf("%s: exit %d\n%s", c.name, code, errs)
		}
		t.Logf("%s: %s", c.name, strings.TrimSpace(errs))
	}
}
