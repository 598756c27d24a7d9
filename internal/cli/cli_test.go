package cli

import (
	"bytes"
	"errors"
	"flag"
	"strings"
	"testing"
	"time"
)

// testCommand is a command with a flag of every kind help has to name.
func testCommand() (Command, *flag.FlagSet) {
	c := Command{Name: "demo", Synopsis: "prog demo [flags]", About: "Does a demo.",
		Examples: []string{"prog demo -n 3"}, Hidden: []string{"internal"}}
	fs := NewFlagSet("prog demo")
	fs.Int("n", 0, "how many")
	fs.Int("retries", 3, "tries after the first")
	fs.String("out", "", "where to write")
	fs.String("mode", "fast", "fast or slow")
	fs.Float64("ratio", 0, "a ratio")
	fs.Duration("wait", time.Second, "how long, `default` 1s")
	fs.Bool("quiet", false, "say nothing")
	fs.Bool("internal", false, "internal: for child processes")
	fs.String("name", "", "the `qvd NAME` of it")
	return c, fs
}

// TestPrintHelp: synopsis, about, flags sorted with placeholders (from the type, or the
// table for a known name), defaults only where non-zero and not in the usage, no hidden
// flag, no backquoted word taken for the value's name, examples.
func TestPrintHelp(t *testing.T) {
	c, fs := testCommand()
	var b bytes.Buffer
	PrintHelp(&b, c, fs)
	want := `Usage: prog demo [flags]

Does a demo.

Flags:
  -mode STRING
    	fast or slow (default "fast")
  -n N
    	how many
  -name STRING
    	the ` + "`qvd NAME`" + ` of it
  -out DIR
    	where to write
  -quiet
    	say nothing
  -ratio X
    	a ratio
  -retries N
    	tries after the first (default 3)
  -wait DURATION
    	how long, ` + "`default`" + ` 1s

Examples:
  prog demo -n 3
`
	if b.String() != want {
		t.Errorf("help:\n%s\nwant:\n%s", b.String(), want)
	}
	b.Reset()
	PrintHelp(&b, Command{Synopsis: "prog x"}, nil)
	if b.String() != "Usage: prog x\n" {
		t.Errorf("flagless help %q", b.String())
	}
}

// TestParse: -h prints the help (or hands the FlagSet to a Collector) and is flag.ErrHelp;
// a bad flag is the flag package's error, printed by nobody.
func TestParse(t *testing.T) {
	c, fs := testCommand()
	var out bytes.Buffer
	if err := Parse(fs, c, []string{"-h"}, &out); !errors.Is(err, flag.ErrHelp) || !strings.HasPrefix(out.String(), "Usage: prog demo") {
		t.Errorf("-h: %v, %q", err, out.String())
	}
	_, fs = testCommand()
	col := &Collector{Writer: &out}
	out.Reset()
	if err := Parse(fs, c, []string{"--help"}, col); !errors.Is(err, flag.ErrHelp) || col.FlagSet != fs || out.Len() != 0 {
		t.Errorf("collector: %v, %v, %q", err, col.FlagSet, out.String())
	}
	_, fs = testCommand()
	if err := Parse(fs, c, []string{"--nosuch"}, &out); err == nil || !strings.Contains(err.Error(), "-nosuch") || out.Len() != 0 {
		t.Errorf("bad flag: %v, %q", err, out.String())
	}
}

func TestParseOneArg(t *testing.T) {
	c, _ := testCommand()
	for _, tc := range []struct {
		args []string
		arg  string
		err  string
	}{
		{[]string{"peer:1", "-n", "2"}, "peer:1", ""},
		{[]string{"-n", "2", "peer:1"}, "peer:1", ""},
		{[]string{"-n", "2"}, "", "missing argument"},
		{[]string{"a", "b"}, "", `unexpected argument "b"`},
		{[]string{"-n", "2", "a", "b"}, "", `unexpected argument "a"`},
	} {
		_, fs := testCommand()
		arg, err := ParseOneArg(fs, c, tc.args, &bytes.Buffer{})
		if arg != tc.arg || (err == nil) != (tc.err == "") || (err != nil && err.Error() != tc.err) {
			t.Errorf("%q: %q, %v; want %q, %q", tc.args, arg, err, tc.arg, tc.err)
		}
	}
}

func TestIsHelpArg(t *testing.T) {
	for args, want := range map[string]bool{"-h": true, "-help": true, "--help": true, "--helpme": false, "-h -h": false, "": false} {
		if got := IsHelpArg(strings.Fields(args)); got != want {
			t.Errorf("%q: %v", args, got)
		}
	}
}

// microFlag names its own placeholder, as qvd's --micro-batch does.
type microFlag struct{}

func (microFlag) String() string      { return "" }
func (microFlag) Set(string) error    { return nil }
func (microFlag) Placeholder() string { return "N|auto" }

func TestPlaceholder(t *testing.T) {
	fs := NewFlagSet("p")
	fs.Var(microFlag{}, "micro-batch", "")
	fs.Uint64("seed", 0, "")
	fs.String("transport", "", "")
	var o *int
	Optional(fs, &o, "master-port", "")
	var e *int
	Optional(fs, &e, "epochs", "")
	var s *string
	Optional(fs, &s, "title", "")
	for name, want := range map[string]string{"micro-batch": "N|auto", "seed": "N", "transport": "auto|shm|tcp|grpc|nccl",
		"master-port": "PORT", "epochs": "N", "title": "TITLE"} {
		if got := Placeholder(fs.Lookup(name)); got != want {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	}
}

// TestOptional: the pointer stays nil until the flag is given; values and errors are the
// standard flag's; help shows no default.
func TestOptional(t *testing.T) {
	fs := NewFlagSet("p")
	var n *int
	var lr *float64
	var s *string
	var big *int64
	var u *uint64
	Optional(fs, &n, "n", "")
	Optional(fs, &lr, "lr", "")
	Optional(fs, &s, "s", "")
	Optional(fs, &big, "big", "")
	Optional(fs, &u, "u", "")
	if err := fs.Parse([]string{"-n", "0", "-lr", "0.5", "-big", "1099511627776"}); err != nil {
		t.Fatal(err)
	}
	if n == nil || *n != 0 || lr == nil || *lr != 0.5 || big == nil || *big != 1<<40 || s != nil || u != nil {
		t.Errorf("n %v lr %v big %v s %v u %v", n, lr, big, s, u)
	}
	for _, f := range []string{"n", "s", "u"} {
		if !zeroDefault(fs.Lookup(f)) {
			t.Errorf("-%s: default %q shown", f, fs.Lookup(f).DefValue)
		}
	}
	std := flag.NewFlagSet("p", flag.ContinueOnError)
	std.SetOutput(&bytes.Buffer{})
	std.Int("n", 0, "")
	want := std.Parse([]string{"-n", "x"})
	if err := fs.Parse([]string{"-n", "x"}); err == nil || err.Error() != want.Error() {
		t.Errorf("bad value: %v, want the flag package's %v", err, want)
	}
}

// TestSplitKnown: the command's own flags (with their values, in either form) up to the first
// argument it does not know; bool flags take no value.
func TestSplitKnown(t *testing.T) {
	fs := NewFlagSet("p")
	fs.Int("nproc", 2, "")
	fs.String("host", "", "")
	fs.Bool("v", false, "")
	for _, tc := range []struct{ args, own, rest string }{
		{"--nproc 4 -c x --epochs 1", "--nproc 4", "-c x --epochs 1"},
		{"--nproc=4 -v --host h --help -c x", "--nproc=4 -v --host h --help", "-c x"},
		{"-h", "-h", ""},
		{"--nproc", "--nproc", ""},
		{"-c x --nproc 4", "", "-c x --nproc 4"},
	} {
		own, rest := SplitKnown(fs, strings.Fields(tc.args))
		if strings.Join(own, " ") != tc.own || strings.Join(rest, " ") != tc.rest {
			t.Errorf("%q: own %q rest %q, want %q %q", tc.args, own, rest, tc.own, tc.rest)
		}
	}
}

// TestCompletion: both scripts list the commands, a command's first arguments and its
// visible flags (-x, --long), never a hidden one; another shell is ErrShell.
func TestCompletion(t *testing.T) {
	c, fs := testCommand()
	cmds := []Command{c, {Name: "help", Flagless: true, Args: []string{"demo", "help"}}}
	flagsOf := func(c Command) *flag.FlagSet {
		if c.Flagless {
			return nil
		}
		return fs
	}
	for _, shell := range []string{"bash", "zsh"} {
		var b bytes.Buffer
		if err := Completion(&b, "prog", shell, cmds, flagsOf); err != nil {
			t.Fatal(err)
		}
		s := b.String()
		for _, w := range []string{"demo help", "-n", "--retries", "--quiet", "_prog"} {
			if !strings.Contains(s, w) {
				t.Errorf("%s: no %q in\n%s", shell, w, s)
			}
		}
		if strings.Contains(s, "--internal") {
			t.Errorf("%s offers a hidden flag", shell)
		}
	}
	if err := Completion(&bytes.Buffer{}, "prog", "fish", cmds, flagsOf); !errors.Is(err, ErrShell) {
		t.Errorf("fish: %v", err)
	}
}
