package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/job"
)

// TestKeygenKeyPasses: keys from `qvd keygen` load and pass the weak-key check, every time;
// a typed key is refused at load with a pointer to `qvd keygen`, naming its file.
func TestKeygenKeyPasses(t *testing.T) {
	dir := t.TempDir()
	for i := range 200 {
		var out, errs bytes.Buffer
		if code := cmdKeygen(nil, &out, &errs); code != exitOK {
			t.Fatalf("keygen: exit %d: %s", code, errs.String())
		}
		p := filepath.Join(dir, "cluster.key")
		if err := os.WriteFile(p, out.Bytes(), 0o600); err != nil {
			t.Fatal(err)
		}
		key, err := job.LoadClusterKey(p, os.Getenv, nil)
		if err != nil {
			t.Fatalf("keygen key %d (%s) refused: %v", i, strings.TrimSpace(out.String()), err)
		}
		if err := cluster.ValidateKey(key); err != nil {
			t.Fatal(err)
		}
	}
	weak := filepath.Join(dir, "weak.key")
	if err := os.WriteFile(weak, []byte("aaaaaaaaaaaaaaaa"), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err := job.LoadClusterKey(weak, os.Getenv, nil)
	if err == nil || !strings.Contains(err.Error(), weak) || !strings.Contains(err.Error(), "qvd keygen") {
		t.Fatalf("weak key file: %v, want an error naming the file and qvd keygen", err)
	}
	t.Log(err)
}
