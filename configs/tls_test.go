package configs

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/pki"
)

// TestTLSSection: the tls section takes ca, cert and key (all three or none), is validated
// with errors naming the field and the file, and refuses unknown keys.
func TestTLSSection(t *testing.T) {
	dir := t.TempDir()
	ca, err := pki.NewCA(time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	cert, key, err := ca.Issue([]string{"node1"}, time.Hour, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for name, b := range map[string][]byte{"ca.pem": ca.CertPEM, "node1.pem": cert, "node1-key.pem": key} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	p := func(name string) string { return filepath.Join(dir, name) }

	c := Default()
	if c.TLS.Enabled() || c.Validate() != nil {
		t.Fatalf("default: TLS %+v, %v", c.TLS, c.Validate())
	}
	good := "tls:\n  ca: " + p("ca.pem") + "\n  cert: " + p("node1.pem") + "\n  key: " + p("node1-key.pem") + "\n"
	c, err = Parse([]byte(good), "test")
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Validate(); err != nil || c.TLS.Cert != p("node1.pem") {
		t.Fatalf("good tls section: %+v, %v", c.TLS, err)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"tls:\n  ca: " + p("ca.pem") + "\n", "tls.cert: missing"},
		{"tls:\n  ca: " + p("ca.pem") + "\n  cert: " + p("node1.pem") + "\n  key: " + p("nope.pem") + "\n", "tls.key: open " + p("nope.pem")},
		{"tls:\n  ca: " + p("node1-key.pem") + "\n  cert: " + p("node1.pem") + "\n  key: " + p("node1-key.pem") + "\n", "tls.ca: " + p("node1-key.pem") + " holds no PEM certificate"},
	} {
		c, err := Parse([]byte(bad.yaml), "test")
		if err == nil {
			err = c.Validate()
		}
		if err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: got %v, want %q", bad.yaml, err, bad.want)
		}
	}
	if _, err := Parse([]byte("tls:\n  certificate: x\n"), "test"); err == nil || !strings.Contains(err.Error(), "tls.certificate") {
		t.Errorf("unknown key: %v", err)
	}
}
