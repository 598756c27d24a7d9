//go:build integration

package main

import (
	"os"
	"os/exec"
	"testing"
)

// TestComposeCluster runs scripts/compose-test.sh: a four-container cluster trains a job to
// completion, then survives (by failing fast, naming the lost rank) a worker cut off the
// network. It needs Docker and docker-compose:
//
//	go test -tags integration -run TestComposeCluster -timeout 15m ./cmd/qvd
func TestComposeCluster(t *testing.T) {
	if err := exec.Command("docker", "info").Run(); err != nil {
		t.Skipf("no working Docker engine: %v", err)
	}
	if _, err := exec.LookPath("docker-compose"); err != nil {
		t.Skip("docker-compose not installed")
	}
	cmd := exec.Command("../../scripts/compose-test.sh")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("compose test: %v", err)
	}
}
