package cluster

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestValidateKey: keys people type — one byte repeated, all zeros, a repeated pattern, a
// counting sequence, words — are refused with ErrWeakKey and a pointer to `qvd keygen`;
// random keys of every length, as `qvd keygen` makes them, pass.
func TestValidateKey(t *testing.T) {
	seq := make([]byte, 32)
	down := make([]byte, 16)
	for i := range seq {
		seq[i] = byte(i)
	}
	for i := range down {
		down[i] = byte(200 - 3*i)
	}
	for _, tc := range []struct {
		name string
		key  []byte
	}{
		{"aaaaaaaaaaaaaaaa", []byte("aaaaaaaaaaaaaaaa")},
		{"all zeros (16)", make([]byte, 16)},
		{"all zeros (32)", make([]byte, 32)},
		{"one byte repeated", bytes.Repeat([]byte{0x5a}, 32)},
		{"two bytes alternating", bytes.Repeat([]byte{0x00, 0xff}, 12)},
		{"passwordpassword", []byte("passwordpassword")},
		{"4-byte pattern", bytes.Repeat([]byte{0x9e, 0x37, 0x79, 0xb9}, 8)},
		{"16-byte random block twice", append(mustHex("bde22900e1b7eb95844631756a8f5c39"), mustHex("bde22900e1b7eb95844631756a8f5c39")...)},
		{"counting up 00..1f", seq},
		{"counting down by 3", down},
		{"ascii 0123456789abcdef", []byte("0123456789abcdef")},
		{"dictionary words", []byte("correcthorsebatterystaplesunrise")},
		{"a password", []byte("Tr0ub4dor&3-secr")},
		{"24 printable characters", []byte("my cluster key, 2024 ok!")},
	} {
		err := ValidateKey(tc.key)
		if !errors.Is(err, ErrWeakKey) || !strings.Contains(err.Error(), "qvd keygen") {
			t.Errorf("%s (% x): got %v, want ErrWeakKey telling to run qvd keygen", tc.name, tc.key, err)
			continue
		}
		t.Logf("%s: %v", tc.name, err)
	}

	// Wrong lengths are not weak, just wrong.
	for _, n := range []int{0, 8, 20, 64} {
		if err := ValidateKey(make([]byte, n)); err == nil || errors.Is(err, ErrWeakKey) {
			t.Errorf("%d-byte key: got %v, want a length error", n, err)
		}
	}

	// Random keys pass, every time: the checks' false-positive rates are negligible except
	// the all-printable one for 16-byte keys (1.3e-7), which this many draws will not hit.
	for _, k := range [][]byte{testKey, otherKey, mustHex("bde22900e1b7eb95844631756a8f5c39eec392e3b79a2d31dac777fce2017365")} {
		if err := ValidateKey(k); err != nil {
			t.Errorf("fixed random key %x: %v", k, err)
		}
	}
	draws := 20000
	if testing.Short() {
		draws = 2000
	}
	for _, n := range []int{16, 24, 32} {
		k := make([]byte, n)
		for range draws {
			if _, err := rand.Read(k); err != nil {
				t.Fatal(err)
			}
			if err := ValidateKey(k); err != nil {
				t.Fatalf("random %d-byte key %x refused: %v", n, k, err)
			}
		}
	}
	// `qvd keygen` prints 32 random bytes in hex; the loader decodes them.
	var kg [32]byte
	_, _ = rand.Read(kg[:])
	if k, err := hex.DecodeString(hex.EncodeToString(kg[:])); err != nil || ValidateKey(k) != nil {
		t.Fatalf("a keygen key: %v / %v", err, ValidateKey(k))
	}
}

// TestNewRefusesWeakKey: New refuses a weak key, naming the field; the error matches both
// ErrConfig and ErrWeakKey. Config.Validate checks only the length, since configs validates
// a configuration with a placeholder key before the real one is read.
func TestNewRefusesWeakKey(t *testing.T) {
	for _, k := range [][]byte{[]byte("aaaaaaaaaaaaaaaa"), make([]byte, 32)} {
		c := testConfig("n")
		c.Key = k
		if err := c.Validate(); err != nil {
			t.Fatalf("Validate with a placeholder key: %v", err)
		}
		_, err := New(c, Meta{Role: RoleWorker}, zap.NewNop())
		if !errors.Is(err, ErrConfig) || !errors.Is(err, ErrWeakKey) || !strings.HasPrefix(err.Error(), "key: weak key") {
			t.Fatalf("New with key %x: got %v, want an ErrConfig and ErrWeakKey naming key", k, err)
		}
	}
}

// TestKeyFileModeWarning: a key file that group or others may read is read, with a
// warning naming the file and its mode and saying chmod 600; a 0600 file is read silently.
// The TLS private key gets the same check.
func TestKeyFileModeWarning(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, b []byte, mode os.FileMode) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil { // umask may have narrowed it
			t.Fatal(err)
		}
		return p
	}
	key := []byte(hex.EncodeToString(testKey) + "\n")
	for _, tc := range []struct {
		mode os.FileMode
		warn bool
	}{{0o600, false}, {0o400, false}, {0o640, true}, {0o644, true}, {0o604, true}, {0o660, true}} {
		p := write("cluster.key", key, tc.mode)
		core, logs := observer.New(zapcore.InfoLevel)
		b, err := ReadKeyFile(p, zap.New(core))
		if err != nil || !bytes.Equal(b, key) {
			t.Fatalf("mode %04o: read %q, %v", tc.mode, b, err)
		}
		warns := logs.FilterLevelExact(zapcore.WarnLevel).All()
		if !tc.warn {
			if logs.Len() != 0 {
				t.Errorf("mode %04o: unexpected log %v", tc.mode, logs.All())
			}
			_ = os.Remove(p)
			continue
		}
		if len(warns) != 1 {
			t.Fatalf("mode %04o: %d warnings, want 1: %v", tc.mode, len(warns), logs.All())
		}
		msg := warns[0].Message
		for _, want := range []string{p, "chmod 600 " + p, "mode 0" + octal(tc.mode)} {
			if !strings.Contains(msg, want) {
				t.Errorf("mode %04o: warning %q does not say %q", tc.mode, msg, want)
			}
		}
		_ = os.Remove(p)
	}

	// The TLS private key.
	ca := newCA(t)
	_, cert, nodeKey := issue(t, ca)
	files := TLSConfig{CA: write("ca.pem", ca.CertPEM, 0o644), Cert: write("node.pem", cert, 0o644), Key: write("node-key.pem", nodeKey, 0o644)}
	core, logs := observer.New(zapcore.InfoLevel)
	if _, err := files.Load(zap.New(core)); err != nil {
		t.Fatal(err)
	}
	if w := logs.FilterLevelExact(zapcore.WarnLevel).All(); len(w) != 1 || !strings.Contains(w[0].Message, files.Key) {
		t.Errorf("TLS key of mode 0644: warnings %v, want one naming %s", w, files.Key)
	}
}

func octal(m os.FileMode) string {
	const digits = "01234567"
	p := m.Perm()
	return string([]byte{digits[p>>6&7], digits[p>>3&7], digits[p&7]})
}
