package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/version"
)

// command is one qvd subcommand as help and completion see it. Its flags come from the
// command itself: help and completion run it with --help (see flagsOf), so what they show
// is the FlagSet that parses its arguments and cannot drift from it.
type command struct {
	name     string
	synopsis string   // one line: "qvd train [-c CONFIG] [flags]"
	about    string   // optional paragraphs between the synopsis and the flags
	examples []string // 1-3 command lines
	// hidden are flags only qvd passes to its own child processes: accepted, not shown.
	hidden []string
	// flagless commands take no flags: dispatch answers their -h itself.
	flagless bool
	run      func(ctx context.Context, args []string, stdout, stderr io.Writer) int
}

// commands is the registry that dispatch, help and completion share, in overview order.
// A function, not a variable: the commands' code refers back to it.
func commands() []command {
	noCtx := func(f func([]string, io.Writer, io.Writer) int) func(context.Context, []string, io.Writer, io.Writer) int {
		return func(_ context.Context, args []string, stdout, stderr io.Writer) int { return f(args, stdout, stderr) }
	}
	return []command{
		{name: "train", synopsis: "qvd train [-c CONFIG] [flags]",
			about: "Trains a model on this machine (default config: the embedded " + configs.DefaultName + "). With --nodes N > 1\nit coordinates a job of N processes: the others run qvd join.",
			examples: []string{"qvd train -c fashion-mlp --epochs 3 --out runs/mlp",
				"qvd train --resume auto --out runs/mlp",
				"qvd train --nodes 2 --bind 0.0.0.0:7946 --cluster-key-file cluster.key"},
			run: cmdTrain},
		{name: "join", synopsis: "qvd join PEER [--bind HOST:PORT] [--cluster-key-file FILE] [flags]",
			about:    "Joins a cluster through any member and trains the job it runs. PEER is the gossip\naddress of any member (e.g. the coordinator's --bind).",
			examples: []string{"qvd join node0:7946 --bind 0.0.0.0:7946 --cluster-key-file cluster.key"},
			run:      cmdJoin},
		{name: "launch", synopsis: "qvd launch --nproc N [--nnodes M --node-rank R --master-addr HOST] [train flags]",
			about: "Runs an N-process job on this machine (or one machine's share of a multi-machine job).\nEverything from the first flag launch does not know on goes to the coordinator's qvd train.",
			examples: []string{"qvd launch --nproc 4 -c fashion-mlp --out runs/mlp4",
				"qvd launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr node0 -c fashion-cnn"},
			run: cmdLaunch},
		{name: "status", synopsis: "qvd status PEER [--cluster-key-file FILE] [--tls-ca FILE --tls-cert FILE --tls-key FILE]",
			about:    "Lists a cluster's members, joining through PEER as an observer.",
			examples: []string{"qvd status node0:7946 --cluster-key-file cluster.key"},
			run:      cmdStatus},
		{name: "bench", synopsis: "qvd bench allreduce|reducescatter|allgather|broadcast --nproc N [flags]",
			about:    "Measures a collective across N local processes as nccl-tests reports it: algbw, busbw\nand #wrong per size.",
			examples: []string{"qvd bench allreduce --nproc 4", "qvd bench allgather --nproc 2 --sizes 1MiB,64MiB --dtype bf16 --transport tcp"},
			hidden:   []string{"serve", "join", "bind", "grpc-bind", "advertise", "node-name"},
			run:      cmdBench},
		{name: "gpus", synopsis: "qvd gpus [--json] [--require]",
			about:    "Lists the GPUs NVML sees: memory, utilisation, temperature, power, driver and CUDA versions.",
			examples: []string{"qvd gpus", "qvd gpus --json --require"},
			run:      noCtx(cmdGPUs)},
		{name: "keygen", flagless: true, synopsis: "qvd keygen > cluster.key",
			about:    "Prints a new random cluster key (hex).",
			examples: []string{"qvd keygen > cluster.key"},
			run:      noCtx(cmdKeygen)},
		{name: "certs", synopsis: "qvd certs --out DIR --hosts H1,H2,...",
			about:    "Makes a cluster CA (ca.pem, ca-key.pem) and, per host, HOST.pem and HOST-key.pem\nfor --tls-ca DIR/ca.pem --tls-cert DIR/HOST.pem --tls-key DIR/HOST-key.pem.\nWith ca.pem and ca-key.pem already in DIR, it adds hosts to that CA.",
			examples: []string{"qvd certs --out certs --hosts node0,node1+10.0.0.5"},
			run:      noCtx(cmdCerts)},
		{name: "estimate", synopsis: "qvd estimate (--params N | -c CONFIG) [--world N] [--stage S] [--offload none|cpu] [flags]",
			about: "Prints per-rank memory of ZeRO stages 0-2; with --recommend, a micro-batch and\naccumulation for --memory and --effective-batch.",
			examples: []string{"qvd estimate --params 1.3e9 --world 8 --stage 2",
				"qvd estimate -c fashion-mlp --recommend --memory 24GiB --effective-batch 32"},
			run: noCtx(cmdEstimate)},
		{name: "plot", synopsis: "qvd plot METRICS.jsonl|RUN_DIR [-o PNG] [--csv FILE] [--title T]",
			about:    "Plots a run's metrics.jsonl (or its run directory) to a PNG.",
			examples: []string{"qvd plot runs/mlp", "qvd plot runs/mlp/metrics.jsonl -o curves.png --csv metrics.csv"},
			run:      noCtx(cmdPlot)},
		{name: "eval", synopsis: "qvd eval [-c CONFIG] --checkpoint RUN_DIR|CHECKPOINT_DIR|MODEL.safetensors [--data DIR] [--json FILE]",
			about: "Evaluates trained weights on the config's test set: prints accuracy, loss and the confusion\n" +
				"matrix (rows: true class), and with --json writes them as JSON. A run directory means its\n" +
				"newest checkpoint that verifies, as --resume auto picks it.",
			examples: []string{"qvd eval -c fashion-mlp --checkpoint runs/mlp",
				"qvd eval -c fashion-cnn --checkpoint runs/cnn/checkpoints/step-00009380 --json eval.json"},
			run: noCtx(cmdEval)},
		{name: "predict", synopsis: "qvd predict [-c CONFIG] --checkpoint PATH [--top-k K] [--json] IMAGE...",
			about: "Prints the most probable classes, with their softmax probabilities, for PNG or JPEG images:\n" +
				"converted to the model's channels (grey or RGB), resized bilinearly to its input size and\n" +
				"normalised as in training. PATH is what qvd eval's --checkpoint takes.",
			examples: []string{"qvd predict -c fashion-mlp --checkpoint runs/mlp shoe.png",
				"qvd predict -c fashion-cnn --checkpoint runs/cnn --top-k 5 --json a.png b.jpg"},
			run: noCtx(cmdPredict)},
		{name: "dashboard", synopsis: "qvd dashboard METRICS.jsonl|RUN_DIR|PEER [--addr HOST:PORT] [--peer PEER]",
			about: "Serves a live web page of a run's metrics.jsonl: loss, test accuracy, throughput, memory\n" +
				"by category with the phase peaks, memory per rank, the cluster's members and recent events\n" +
				"(re-forms, lost members, stops, skipped and OOM-skipped steps), updated every second. With\n" +
				"PEER (a member's gossip address) it joins the cluster as an observer, as qvd status does,\n" +
				"and shows the members' rank, step, generation, health and memory live.",
			examples: []string{"qvd dashboard runs/mlp", "qvd dashboard 10.0.0.1:7946 --addr 0.0.0.0:8080",
				"qvd dashboard runs/mlp --peer 10.0.0.1:7946"},
			run: cmdDashboard},
		{name: "config", synopsis: "qvd config [-c CONFIG] [flags]",
			about:    "Prints the resolved configuration as YAML: defaults, the config, DeepSpeed JSON, flags.",
			examples: []string{"qvd config -c fashion-mlp --zero-stage 2", "qvd config --deepspeed ds_config.json"},
			run:      noCtx(cmdConfig)},
		{name: "completion", flagless: true, synopsis: "qvd completion bash|zsh",
			about: "Prints a shell completion script for qvd's commands and their flags.",
			examples: []string{"source <(qvd completion bash)",
				"qvd completion zsh > \"${fpath[1]}/_qvd\""},
			run: noCtx(cmdCompletion)},
		{name: "version", flagless: true, synopsis: "qvd version",
			about: "Prints the version.", examples: []string{"qvd version"},
			run: noCtx(cmdVersion)},
		{name: "help", flagless: true, synopsis: "qvd help [COMMAND]",
			about: "Prints the overview, or a command's help.", examples: []string{"qvd help", "qvd help train"},
			run: noCtx(cmdHelp)},
	}
}

func lookupCommand(name string) (command, bool) {
	for _, c := range commands() {
		if c.name == name {
			return c, true
		}
	}
	return command{}, false
}

// commandOf is the registry entry of a FlagSet named "qvd CMD ..." (bench's is "qvd bench
// allreduce").
func commandOf(fs *flag.FlagSet) command {
	words := strings.Fields(fs.Name())
	if len(words) >= 2 {
		if c, ok := lookupCommand(words[1]); ok {
			return c
		}
	}
	return command{name: strings.TrimPrefix(fs.Name(), "qvd "), synopsis: fs.Name() + " [flags]"}
}

// newFlagSet is a command's FlagSet. The flag package prints nothing itself: parseFlags
// reports a bad flag in one line and prints the help for -h.
func newFlagSet(name string) *flag.FlagSet {
	fs := flag.NewFlagSet("qvd "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	return fs
}

// parseFlags parses args into fs. It reports false with the exit code when the command
// should stop: 0 after printing the help for -h/--help, exitUsage after a one-line error.
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (int, bool) {
	err := fs.Parse(args)
	switch {
	case err == nil:
		return exitOK, true
	case errors.Is(err, flag.ErrHelp):
		if c, ok := stdout.(*flagCollector); ok {
			c.fs = fs
			return exitOK, false
		}
		printHelp(stdout, commandOf(fs), fs)
		return exitOK, false
	default:
		return usageError(fs, stderr, "%v", err), false
	}
}

// usageError prints "qvd CMD: message (see qvd CMD --help)" and returns exitUsage.
func usageError(fs *flag.FlagSet, stderr io.Writer, format string, a ...any) int {
	c := commandOf(fs)
	fmt.Fprintf(stderr, "qvd %s: %s (see qvd %s --help)\n", c.name, fmt.Sprintf(format, a...), c.name)
	return exitUsage
}

// isHelpArg reports whether args asks for help and nothing else.
func isHelpArg(args []string) bool {
	return len(args) == 1 && (args[0] == "-h" || args[0] == "-help" || args[0] == "--help")
}

// flagCollector is a stdout that makes parseFlags hand back the command's FlagSet on
// --help instead of printing it: flagsOf runs a command to learn its flags.
type flagCollector struct {
	io.Writer
	fs *flag.FlagSet
}

// flagsOf is c's FlagSet, got by running it with --help; nil for a command without flags.
func flagsOf(c command) *flag.FlagSet {
	if c.flagless {
		return nil
	}
	col := &flagCollector{Writer: io.Discard}
	c.run(context.Background(), []string{"--help"}, col, io.Discard)
	return col.fs
}

// printHelp prints c's help: synopsis, about, flags, examples.
func printHelp(w io.Writer, c command, fs *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: %s\n", c.synopsis)
	if c.about != "" {
		fmt.Fprintf(w, "\n%s\n", c.about)
	}
	if fs != nil && len(visibleFlags(c, fs)) > 0 {
		fmt.Fprint(w, "\nFlags:\n")
		printFlags(w, c, fs)
	}
	if len(c.examples) > 0 {
		fmt.Fprint(w, "\nExamples:\n")
		for _, e := range c.examples {
			fmt.Fprintf(w, "  %s\n", e)
		}
	}
}

func visibleFlags(c command, fs *flag.FlagSet) []*flag.Flag {
	var out []*flag.Flag
	fs.VisitAll(func(f *flag.Flag) {
		for _, h := range c.hidden {
			if f.Name == h {
				return
			}
		}
		out = append(out, f)
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// placeholders name the value of flags whose type says too little ("string").
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
func printFlags(w io.Writer, c command, fs *flag.FlagSet) {
	for _, f := range visibleFlags(c, fs) {
		line := "  -" + f.Name
		if p := placeholder(f); p != "" {
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

func placeholder(f *flag.Flag) string {
	t, _ := flagType(f)
	if t == "" {
		return ""
	}
	if _, ok := f.Value.(*microBatchFlag); ok {
		return "N|auto"
	}
	if p, ok := placeholders[f.Name]; ok {
		return p
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

func cmdVersion(_ []string, stdout, _ io.Writer) int {
	fmt.Fprintf(stdout, "qvd %s\n", version.Version)
	return exitOK
}

// commandHelp prints c's help and returns its exit code (0).
func commandHelp(c command, stdout, stderr io.Writer) int {
	if c.flagless {
		printHelp(stdout, c, nil)
		return exitOK
	}
	return c.run(context.Background(), []string{"--help"}, stdout, stderr)
}

func cmdHelp(args []string, stdout, stderr io.Writer) int {
	switch len(args) {
	case 0:
		fmt.Fprint(stdout, usage)
		return exitOK
	case 1:
		c, ok := lookupCommand(args[0])
		if !ok {
			fmt.Fprintf(stderr, "qvd help: unknown command %q (see qvd help)\n", args[0])
			return exitUsage
		}
		return commandHelp(c, stdout, stderr)
	}
	fmt.Fprintln(stderr, "qvd help: takes one command (see qvd help help)")
	return exitUsage
}

// completionFlags are c's visible flags as a shell offers them: -c, --name.
func completionFlags(c command) []string {
	fs := flagsOf(c)
	if fs == nil {
		return nil
	}
	var out []string
	for _, f := range visibleFlags(c, fs) {
		if len(f.Name) == 1 {
			out = append(out, "-"+f.Name)
		} else {
			out = append(out, "--"+f.Name)
		}
	}
	return out
}

// completionArgs are the words a command takes as its first argument.
func completionArgs(c command) []string {
	switch c.name {
	case "bench":
		var colls []string
		for name := range benchColls {
			colls = append(colls, name)
		}
		sort.Strings(colls)
		return colls
	case "completion":
		return []string{"bash", "zsh"}
	case "help":
		var names []string
		for _, c := range commands() {
			names = append(names, c.name)
		}
		return names
	}
	return nil
}

func cmdCompletion(args []string, stdout, stderr io.Writer) int {
	if len(args) != 1 || (args[0] != "bash" && args[0] != "zsh") {
		fmt.Fprintln(stderr, "qvd completion: give bash or zsh (see qvd completion --help)")
		return exitUsage
	}
	var names []string
	for _, c := range commands() {
		names = append(names, c.name)
	}
	var b strings.Builder
	if args[0] == "bash" {
		fmt.Fprintf(&b, "# bash completion for qvd: source <(qvd completion bash)\n_qvd() {\n")
		fmt.Fprintf(&b, "    local cur=\"${COMP_WORDS[COMP_CWORD]}\" words=\"\"\n")
		fmt.Fprintf(&b, "    if [[ $COMP_CWORD -eq 1 ]]; then\n        COMPREPLY=($(compgen -W %q -- \"$cur\"))\n        return\n    fi\n", strings.Join(names, " "))
		fmt.Fprintf(&b, "    case \"${COMP_WORDS[1]}\" in\n")
		for _, c := range commands() {
			fmt.Fprintf(&b, "    %s)\n", c.name)
			if a := completionArgs(c); len(a) > 0 {
				fmt.Fprintf(&b, "        if [[ $COMP_CWORD -eq 2 ]]; then words=%q; fi\n", strings.Join(a, " "))
			}
			if f := completionFlags(c); len(f) > 0 {
				fmt.Fprintf(&b, "        if [[ $cur == -* ]]; then words=%q; fi\n", strings.Join(f, " "))
			}
			fmt.Fprintf(&b, "        ;;\n")
		}
		fmt.Fprintf(&b, "    esac\n")
		fmt.Fprintf(&b, "    if [[ -n $words ]]; then\n        COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))\n    else\n        COMPREPLY=($(compgen -f -- \"$cur\"))\n    fi\n}\n")
		fmt.Fprintf(&b, "complete -o default -F _qvd qvd\n")
	} else {
		fmt.Fprintf(&b, "#compdef qvd\n# zsh completion for qvd: qvd completion zsh > \"${fpath[1]}/_qvd\"\n_qvd() {\n")
		fmt.Fprintf(&b, "    local -a words_\n")
		fmt.Fprintf(&b, "    if (( CURRENT == 2 )); then\n        compadd -- %s\n        return\n    fi\n", strings.Join(names, " "))
		fmt.Fprintf(&b, "    case ${words[2]} in\n")
		for _, c := range commands() {
			fmt.Fprintf(&b, "    %s)\n", c.name)
			if a := completionArgs(c); len(a) > 0 {
				fmt.Fprintf(&b, "        if (( CURRENT == 3 )); then words_=(%s); fi\n", strings.Join(a, " "))
			}
			if f := completionFlags(c); len(f) > 0 {
				fmt.Fprintf(&b, "        if [[ $PREFIX == -* ]]; then words_=(%s); fi\n", strings.Join(f, " "))
			}
			fmt.Fprintf(&b, "        ;;\n")
		}
		fmt.Fprintf(&b, "    esac\n")
		fmt.Fprintf(&b, "    if (( ${#words_} )); then\n        compadd -- $words_\n    else\n        _files\n    fi\n}\n_qvd \"$@\"\n")
	}
	fmt.Fprint(stdout, b.String())
	return exitOK
}
