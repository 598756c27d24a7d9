package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// helpOf is `qvd CMD --help`, which must exit 0 and print the help on stdout.
func helpOf(t *testing.T, args ...string) string {
	t.Helper()
	code, stdout, stderr := runQVD(t, args...)
	if code != exitOK || stdout == "" {
		t.Fatalf("qvd %v: exit %d, want 0 with the help on stdout\nstdout:\n%s\nstderr:\n%s", args, code, stdout, stderr)
	}
	return stdout
}

// TestHelpEveryCommand: -h and --help exit 0 for every command, and `qvd help CMD` prints
// the same text; each help starts with a one-line synopsis and ends with 1-3 examples.
func TestHelpEveryCommand(t *testing.T) {
	for _, c := range commands() {
		t.Run(c.Name, func(t *testing.T) {
			long := helpOf(t, c.Name, "--help")
			if short := helpOf(t, c.Name, "-h"); short != long {
				t.Errorf("-h and --help differ:\n%s\n----\n%s", short, long)
			}
			if viaHelp := helpOf(t, "help", c.Name); viaHelp != long {
				t.Errorf("qvd help %s differs from --help:\n%s\n----\n%s", c.Name, viaHelp, long)
			}
			lines := strings.Split(strings.TrimRight(long, "\n"), "\n")
			if !strings.HasPrefix(lines[0], "Usage: qvd "+c.Name) {
				t.Errorf("first line %q is not the synopsis of qvd %s", lines[0], c.Name)
			}
			ex := strings.LastIndex(long, "\nExamples:\n")
			if ex < 0 {
				t.Fatalf("no Examples section:\n%s", long)
			}
			examples := strings.Split(strings.TrimRight(long[ex+len("\nExamples:\n"):], "\n"), "\n")
			if len(examples) < 1 || len(examples) > 3 {
				t.Errorf("%d examples, want 1-3", len(examples))
			}
			for _, e := range examples {
				if !strings.Contains(e, "qvd "+c.Name) {
					t.Errorf("example %q does not run qvd %s", e, c.Name)
				}
			}
		})
	}
}

// TestHelpOverview: `qvd help`, -h and --help print the overview, which lists every
// command; an unknown command is a one-line error.
func TestHelpOverview(t *testing.T) {
	for _, args := range [][]string{{"help"}, {"-h"}, {"--help"}} {
		out := helpOf(t, args...)
		for _, c := range commands() {
			if !strings.Contains(out, "qvd "+c.Name) {
				t.Errorf("qvd %v does not list %s", args, c.Name)
			}
		}
	}
	for _, args := range [][]string{{"help", "nosuch"}, {"nosuch"}} {
		code, stdout, stderr := runQVD(t, args...)
		if code != exitUsage || stdout != "" || strings.Count(stderr, "\n") != 1 || !strings.Contains(stderr, "nosuch") {
			t.Errorf("qvd %v: exit %d, stdout %q, stderr %q; want exit 2 and one line naming it", args, code, stdout, stderr)
		}
	}
}

// TestHelpFlags checks every command's flag list: internal flags hidden, no backquoted word
// taken for the value's name, a placeholder for each flag with a value, one default at most.
func TestHelpFlags(t *testing.T) {
	flagLine := regexp.MustCompile(`^  -([\w-]+)( (.+))?$`)
	backquoted := regexp.MustCompile(`-\w+ qvd `)
	for _, c := range commands() {
		help := helpOf(t, c.Name, "--help")
		fs := flagsOf(c)
		shown := map[string]bool{}
		for _, line := range strings.Split(help, "\n") {
			if backquoted.MatchString(line) {
				t.Errorf("qvd %s: %q: a backquoted word became the argument name", c.Name, line)
			}
			if strings.Count(line, "default") > 1 {
				t.Errorf("qvd %s: %q gives two defaults", c.Name, line)
			}
			m := flagLine.FindStringSubmatch(line)
			if m == nil || fs == nil {
				continue
			}
			f := fs.Lookup(m[1])
			if f == nil {
				t.Errorf("qvd %s: %q names no flag", c.Name, line)
				continue
			}
			shown[f.Name] = true
			isBool := false
			if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() {
				isBool = true
			}
			if ph := m[3]; isBool != (ph == "") || ph == "string" || ph == "value" {
				t.Errorf("qvd %s: %q: want a placeholder exactly for flags that take a value", c.Name, line)
			}
		}
		for _, h := range c.Hidden {
			if shown[h] {
				t.Errorf("qvd %s shows internal flag -%s", c.Name, h)
			}
			if fs.Lookup(h) == nil {
				t.Errorf("qvd %s: hidden flag -%s is not defined", c.Name, h)
			}
		}
	}
	bench, _ := lookupCommand("bench")
	for _, h := range []string{"serve", "join"} {
		if !contains(bench.Hidden, h) {
			t.Errorf("bench does not hide -%s", h)
		}
	}
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// TestHiddenFlagsAccepted: bench's internal flags still parse (the run then fails on a bad
// --sizes, after the flags were accepted).
func TestHiddenFlagsAccepted(t *testing.T) {
	code, _, stderr := runQVD(t, "bench", "allreduce", "--serve", "--join", "127.0.0.1:1", "--sizes", "nope")
	if code != exitUsage || strings.Contains(stderr, "not defined") || !strings.Contains(stderr, "--sizes") {
		t.Fatalf("exit %d, stderr %q; want the hidden flags accepted and --sizes refused", code, stderr)
	}
}

// TestBadFlagOneLine: an unknown flag is one line naming it and pointing at --help, not the
// whole usage.
func TestBadFlagOneLine(t *testing.T) {
	for _, c := range commands() {
		if c.Flagless {
			continue
		}
		args, name := []string{c.Name, "--nosuch"}, "-nosuch"
		switch c.Name {
		case "bench":
			args = []string{"bench", "allreduce", "--nosuch"}
		case "launch": // launch passes flags it does not know to qvd train: give a bad value
			args, name = []string{"launch", "--nproc", "many"}, "-nproc"
		}
		code, stdout, stderr := runQVD(t, args...)
		if code != exitUsage || stdout != "" || strings.Count(stderr, "\n") > 2 ||
			!strings.Contains(stderr, name) || !strings.Contains(stderr, "qvd "+c.Name+" --help") {
			t.Errorf("qvd %s --nosuch: exit %d, stdout %q, stderr %q; want exit 2 and one line naming the flag and --help", c.Name, code, stdout, stderr)
		}
	}
}

// TestCompletion: the scripts parse in their shells and offer the commands and their flags,
// generated from the FlagSets.
func TestCompletion(t *testing.T) {
	code, script, stderr := runQVD(t, "completion", "bash")
	if code != exitOK {
		t.Fatalf("completion bash: exit %d: %s", code, stderr)
	}
	for _, c := range commands() {
		if !strings.Contains(script, c.Name) {
			t.Errorf("bash completion lacks command %s", c.Name)
		}
	}
	for _, f := range []string{"--max-steps", "--zero-stage", "--resume", "--nodes", "-c"} {
		if !regexp.MustCompile(`[\s"(]` + regexp.QuoteMeta(f) + `[\s")]`).MatchString(script) {
			t.Errorf("bash completion lacks train's %s", f)
		}
	}
	if strings.Contains(script, "--serve") {
		t.Error("bash completion offers bench's internal --serve")
	}
	checkShell(t, "bash", script)
	code, script, stderr = runQVD(t, "completion", "zsh")
	if code != exitOK || !strings.HasPrefix(script, "#compdef qvd") || !strings.Contains(script, "--max-steps") {
		t.Fatalf("completion zsh: exit %d: %s\n%s", code, stderr, script)
	}
	checkShell(t, "zsh", script)
	if code, _, _ := runQVD(t, "completion", "fish"); code != exitUsage {
		t.Errorf("completion fish: exit %d, want %d", code, exitUsage)
	}
}

// checkShell runs `shell -n` on script in a subtest, skipped where the shell is not installed.
func checkShell(t *testing.T, shell, script string) {
	t.Run(shell+" -n", func(t *testing.T) {
		path, err := exec.LookPath(shell)
		if err != nil {
			t.Skipf("%s not installed", shell)
		}
		file := filepath.Join(t.TempDir(), "qvd."+shell)
		if err := os.WriteFile(file, []byte(script), 0o644); err != nil {
			t.Fatal(err)
		}
		if out, err := exec.Command(path, "-n", file).CombinedOutput(); err != nil {
			t.Errorf("%s -n: %v\n%s", shell, err, out)
		}
	})
}
