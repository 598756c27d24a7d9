package pki

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestWriteDir: a fresh directory gets a CA and a certificate per host; a second run for
// the same host overwrites nothing; a new host is issued from the existing CA.
func TestWriteDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "certs")
	var said []string
	note := func(s string) { said = append(said, s) }
	now := time.Now()
	if err := WriteDir(dir, [][]string{{"node1", "10.0.0.5"}, {"::1"}}, time.Hour*24, now, note); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"ca.pem", "ca-key.pem", "node1.pem", "node1-key.pem", "__1.pem", "__1-key.pem"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
	if len(said) != 6 || !strings.HasPrefix(said[0], "wrote ") {
		t.Errorf("progress %q", said)
	}
	if err := WriteDir(dir, [][]string{{"node1"}}, time.Hour, now, note); err == nil || !strings.Contains(err.Error(), "not overwriting") {
		t.Errorf("second run: %v", err)
	}
	said = nil
	if err := WriteDir(dir, [][]string{{"node2"}}, time.Hour, now, note); err != nil || len(said) != 3 || !strings.HasPrefix(said[0], "using the existing CA") {
		t.Errorf("new host from the CA: %v, %q", err, said)
	}
}
