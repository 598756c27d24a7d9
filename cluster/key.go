package cluster

import (
	"errors"
	"fmt"
	"io"
	"math"
	"os"

	"go.uber.org/zap"
)

// ErrWeakKey marks a cluster key that is not random bytes: too few distinct bytes, a
// repeated pattern, a counting sequence, or text.
var ErrWeakKey = errors.New("cluster: weak cluster key")

// weakKeyError says why a key is weak and how to get a good one; it matches ErrWeakKey.
type weakKeyError string

func (e weakKeyError) Error() string {
	return "weak key: " + string(e) + "; make a random one with `qvd keygen`"
}
func (e weakKeyError) Is(target error) bool { return target == ErrWeakKey }

// ValidateKey refuses a cluster key of the wrong length, or one that was evidently not drawn
// at random: it is the gossip encryption key and the root of every gRPC and roster MAC, so a
// guessable key admits anyone. The tests are on the key's bytes (after the hex or base64 of
// a key file is decoded) and each is one that n uniformly random bytes (n = 16, 24 or 32)
// fail with negligible probability:
//
//   - the per-byte Shannon entropy of the key's byte histogram is below log2(n) − 1 bits
//     (n random bytes have log2(n) − 0.1 or so; "aaaa…" has 0, "abab…" 1, all zeros 0);
//   - the key repeats with a period of at most n/2 ("passwordpassword", 0x00112233 ×4):
//     chance ≤ 256^−(n/2) for random bytes;
//   - fewer than n/2 distinct steps between consecutive bytes (0x00 0x01 0x02 …, "abcd…");
//   - every byte is printable ASCII: the key is a typed password or words, whose entropy is
//     a fraction of a random key's (a few bits per character; words, far less). Random bytes
//     are all printable with chance (95/256)^n: 1.7e-14 for a 32-byte key from `qvd keygen`,
//     1.3e-7 for a 16-byte one.
//
// The checks do not prove a key random; they catch the keys people type.
func ValidateKey(key []byte) error {
	if err := checkKeyLength(key); err != nil {
		return err
	}
	n := len(key)
	var hist [256]int
	for _, b := range key {
		hist[b]++
	}
	h := 0.0
	for _, c := range hist {
		if c > 0 {
			p := float64(c) / float64(n)
			h -= p * math.Log2(p)
		}
	}
	if h < math.Log2(float64(n))-1 {
		return weakKeyError(fmt.Sprintf("its %d bytes take only a few values (%.1f bits of entropy per byte, random bytes have about %.1f)",
			n, h, math.Log2(float64(n))))
	}
	for p := 1; p <= n/2; p++ {
		if periodic(key, p) {
			return weakKeyError(fmt.Sprintf("it repeats a %d-byte pattern", p))
		}
	}
	var steps [256]bool
	distinct := 0
	for i := 1; i < n; i++ {
		d := key[i] - key[i-1]
		if !steps[d] {
			steps[d] = true
			distinct++
		}
	}
	if distinct < n/2 {
		return weakKeyError("it is a sequence (its bytes count up or down in a few fixed steps)")
	}
	text := true
	for _, b := range key {
		if b < 0x20 || b > 0x7e {
			text = false
			break
		}
	}
	if text {
		return weakKeyError("it is printable text (a password or words), which has a fraction of the entropy of random bytes")
	}
	return nil
}

// checkKeyLength accepts the AES key sizes.
func checkKeyLength(key []byte) error {
	switch len(key) {
	case 16, 24, 32:
		return nil
	case 0:
		return errors.New("missing: a cluster key of 16, 24 or 32 bytes is required (--cluster-key-file or QVD_CLUSTER_KEY; make one with `qvd keygen`)")
	}
	return fmt.Errorf("must be 16, 24 or 32 bytes (AES), got %d", len(key))
}

func periodic(key []byte, p int) bool {
	for i := p; i < len(key); i++ {
		if key[i] != key[i-p] {
			return false
		}
	}
	return true
}

// ReadKeyFile reads a file holding a secret (the cluster key, a TLS private key) and, as ssh
// does with private keys, warns on log when group or others may read it: anyone who can read
// the cluster key can join the cluster, read gossip and forge rosters. The mode is that of
// the opened file, so it is the file that was read. log may be nil.
func ReadKeyFile(path string, log *zap.Logger) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil {
		warnKeyFileMode(log, path, fi.Mode())
	}
	return io.ReadAll(f)
}

// warnKeyFileMode warns when mode lets group or others read or write the file.
func warnKeyFileMode(log *zap.Logger, path string, mode os.FileMode) {
	if log == nil || mode.Perm()&0o077 == 0 {
		return
	}
	log.Warn(fmt.Sprintf("key file %s is accessible by group or others (mode %04o); it holds a secret: run chmod 600 %s", path, mode.Perm(), path),
		zap.String("file", path), zap.String("mode", fmt.Sprintf("%04o", mode.Perm())))
}
