package launch

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strings"
	"unicode/utf8"
)

// Prepare readies a launch of nproc local workers: their environment (environ, plus a fresh
// cluster key in keyEnv unless keyFile or getenv(keyEnv) has one, plus their share of the
// cores) and where they meet (n.Place). A rendezvous address that cannot be used is
// ErrMasterAddr. keyEnv is job.ClusterKeyEnv, which this package may not import.
func (n Nodes) Prepare(ctx context.Context, keyFile, keyEnv string, nproc int, environ []string, getenv func(string) string) ([]string, Placement, error) {
	env := environ
	if keyFile == "" && getenv(keyEnv) == "" {
		key := make([]byte, 32)
		if _, err := rand.Read(key); err != nil {
			return nil, Placement{}, fmt.Errorf("generating a cluster key: %w", err)
		}
		// Passed in the environment, not on the command line, so it does not show in ps.
		env = append(env, keyEnv+"="+hex.EncodeToString(key))
	}
	env = ShareCores(env, getenv, nproc)
	p, err := n.Place(ctx)
	if err != nil {
		return nil, p, err
	}
	return env, p, nil
}

// ResumeCommand is the command line that resumes a run started as prog with args: the same
// flags, shell-quoted, with --resume auto in place of any --resume (and without --overwrite,
// which moved the old run aside once and refuses --resume).
func ResumeCommand(prog string, args []string) string {
	words := []string{prog}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name, _, inline := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.HasPrefix(a, "-") && name == "resume" {
			if !inline {
				i++ // its value
			}
			continue
		}
		if strings.HasPrefix(a, "-") && name == "overwrite" {
			continue
		}
		words = append(words, shellQuote(a))
	}
	return strings.Join(append(words, "--resume", "auto"), " ")
}

// shellQuote quotes s for a POSIX shell, leaving it bare when it has nothing to quote.
func shellQuote(s string) string {
	safe := func(r rune) bool {
		return r < utf8.RuneSelf && (r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
	}
	if s != "" && strings.IndexFunc(s, func(r rune) bool { return !safe(r) }) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
