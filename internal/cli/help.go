package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
)

// Command is one subcommand as help and completion see it.
type Command struct {
	Name     string
	Synopsis string   // one line: "qvd train [-c CONFIG] [flags]"
	About    string   // optional paragraphs between the synopsis and the flags
	Examples []string // 1-3 command lines
	// Hidden are flags only the program passes to its own child processes: accepted, not shown.
	Hidden []string
	// Flagless commands take no flags: the dispatcher answers their -h itself.
	Flagless bool
	// Args are the words completion offers as the command's first argument.
	Args []string
}

// Placeholderer is a flag.Value that names its own value in help ("N|auto"), where its
// type says too little.
type Placeholderer interface{ Placeholder() string }

// NewFlagSet is a command's FlagSet. The flag package prints nothing itself: Parse reports
// -h, and the caller reports a bad flag in one line.
func NewFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// IsHelpArg reports whether args asks for help and nothing else.
func IsHelpArg(args []string) bool {
	return len(args) == 1 && (args[0] == "-h" || args[0] == "-help" || args[0] == "--help")
}

// Collector is a stdout that makes Parse hand back the command's FlagSet on --help instead
// of printing the help: running a command with one learns its flags (for completion).
type Collector struct {
	io.Writer
	FlagSet *flag.FlagSet
}

// Parse parses args into fs. On -h/--help it prints c's help to stdout (or hands fs to a
// *Collector stdout) and returns flag.ErrHelp; a bad flag is the flag package's error.
func Parse(fs *flag.FlagSet, c Command, args []string, stdout io.Writer) error {
	err := fs.Parse(args)
	if errors.Is(err, flag.ErrHelp) {
		if col, ok := stdout.(*Collector); ok {
			col.FlagSet = fs
		} else {
			PrintHelp(stdout, c, fs)
		}
	}
	return err
}

// ErrMissingArg is ParseOneArg's error when the positional argument is absent.
var ErrMissingArg = errors.New("missing argument")

// ParseOneArg parses a command's flags around its one positional argument (PEER, a path),
// which may come before or after them. Its errors are Parse's, ErrMissingArg, or one that
// names an unexpected extra argument.
func ParseOneArg(fs *flag.FlagSet, c Command, args []string, stdout io.Writer) (string, error) {
	var arg string
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		arg, args = args[0], args[1:]
	}
	if err := Parse(fs, c, args, stdout); err != nil {
		return "", err
	}
	switch {
	case arg == "" && fs.NArg() == 1:
		arg = fs.Arg(0)
	case arg == "" && fs.NArg() == 0:
		return "", ErrMissingArg
	case fs.NArg() > 0:
		return "", fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	return arg, nil
}

// PrintHelp prints c's help: synopsis, about, flags, examples.
func PrintHelp(w io.Writer, c Command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: %s\n", c.Synopsis)
	if c.About != "" {
		fmt.Fprintf(w, "\n%s\n", c.About)
	}
	if fs != nil && len(VisibleFlags(c, fs)) > 0 {
		fmt.Fprint(w, "\nFlags:\n")
		printFlags(w, c, fs)
	}
	if len(c.Examples) > 0 {
		fmt.Fprint(w, "\nExamples:\n")
		for _, e := range c.Examples {
			fmt.Fprintf(w, "  %s\n", e)
		}
	}
}

// VisibleFlags are fs's flags less c's hidden ones, sorted by name.
func VisibleFlags(c Command, fs *flag.FlagSet) []*flag.Flag {
	var out []*flag.Flag
	fs.VisitAll(func(f *flag.Flag) {
		for _, h := range c.Hidden {
			if f.Name == h {
				return
			}
		}
		out = append(out, f)
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// placeholders name the value of qvd's flags whose type says too little ("string").
var placeholders = map[string]string{
	"c": "CONFIG", "config": "CONFIG", "deepspeed": "FILE", "out": "DIR", "data": "DIR",
	"bind": "HOST:PORT", "grpc-bind": "HOST:PORT", "advertise": "HOST:PORT", "metrics-addr": "HOST:PORT",
	"addr": "HOST:PORT", "dashboard-addr": "HOST:PORT", "peer": "HOST:PORT",
	"node-name": "NAME", "cluster-key-file": "FILE", "tls-ca": "FILE", "tls-cert": "FILE", "tls-key": "FILE",
	"resume": "DIR|auto", "host": "HOST", "master-addr": "HOST", "master-port": "PORT", "hosts": "H1,H2,...",
	"o": "PNG", "csv": "FILE", "title": "TITLE", "cpuprofile": "FILE", "sizes": "SIZES", "memory": "BYTES",
	"activation-bytes": "BYTES", "params": "N", "log-level": "LEVEL", "precision": "fp32|fp16|bf16",
	"dtype": "fp32|fp16|bf16", "transport": "auto|shm|tcp|grpc|nccl", "device": "DEVICE", "engine": "ENGINE",
	"offload": "none|cpu", "optimizer": "NAME", "checkpoint": "PATH", "json": "FILE",
}

// printFlags prints fs's visible flags as flag.PrintDefaults lays them out, but without its
// reading of the first `quoted` word of the usage as the value's name, and with a default
// only where the usage does not already say one.
func printFlags(w io.Writer, c Command, fs *flag.FlagSet) {
	for _, f := range VisibleFlags(c, fs) {
		line := "  -" + f.Name
		if p := Placeholder(f); p != "" {
			line += " " + p
		}
		usage := strings.ReplaceAll(f.Usage, "\n", "\n    \t")
		if !zeroDefault(f) && !strings.Contains(f.Usage, "default") {
			if _, isString := flagType(f); isString {
				usage += fmt.Sprintf(" (default %q)", f.DefValue)
			} else {
				usage += fmt.Sprintf(" (default %s)", f.DefValue)
			}
		}
		fmt.Fprintf(w, "%s\n    \t%s\n", line, usage)
	}
}

// flagType is the flag's value type as flag.UnquoteUsage names it ("" for a bool), read
// without the usage text so a `quoted` word cannot stand in for it.
func flagType(f *flag.Flag) (string, bool) {
	bare := *f
	bare.Usage = ""
	name, _ := flag.UnquoteUsage(&bare)
	return name, name == "string"
}

// Placeholder is the name help gives f's value ("N", "HOST:PORT"); "" for a bool flag.
func Placeholder(f *flag.Flag) string {
	t, _ := flagType(f)
	if t == "" {
		return ""
	}
	if p, ok := placeholders[f.Name]; ok {
		return p
	}
	if p, ok := f.Value.(Placeholderer); ok {
		return p.Placeholder()
	}
	switch t {
	case "int", "uint":
		return "N"
	case "float":
		return "X"
	case "duration":
		return "DURATION"
	case "string":
		return "STRING"
	}
	return "VALUE"
}

func zeroDefault(f *flag.Flag) bool {
	switch f.DefValue {
	case "", "0", "false", "0s":
		return true
	}
	return false
}
