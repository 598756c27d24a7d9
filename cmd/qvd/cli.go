package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"

	"github.com/qvd/qvd/collective/bench"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/cli"
	"github.com/qvd/qvd/internal/version"
)

// command is one qvd subcommand: its help (cli.Command) and what runs it. Its flags come
// from the command itself: help and completion run it with --help (see flagsOf), so what
// they show is the FlagSet that parses its arguments and cannot drift from it.
type command struct {
	cli.Command
	run func(ctx context.Context, args []string, stdout, stderr io.Writer) int
}

// commands is the registry that dispatch, help and completion share, in overview order.
// A function, not a variable: the commands' code refers back to it.
func commands() []command {
	noCtx := func(f func([]string, io.Writer, io.Writer) int) func(context.Context, []string, io.Writer, io.Writer) int {
		return func(_ context.Context, args []string, stdout, stderr io.Writer) int { return f(args, stdout, stderr) }
	}
	return []command{
		{Command: cli.Command{Name: "train", Synopsis: "qvd train [-c CONFIG] [flags]",
			About: "Trains a model on this machine (default config: the embedded " + configs.DefaultName + "). With --nodes N > 1\nit coordinates a job of N processes: the others run qvd join.",
			Examples: []string{"qvd train -c fashion-mlp --epochs 3 --out runs/mlp",
				"qvd train --resume auto --out runs/mlp",
				"qvd train --nodes 2 --bind 0.0.0.0:7946 --cluster-key-file cluster.key"}},
			run: cmdTrain},
		{Command: cli.Command{Name: "join", Synopsis: "qvd join PEER [--bind HOST:PORT] [--cluster-key-file FILE] [flags]",
			About:    "Joins a cluster through any member and trains the job it runs. PEER is the gossip\naddress of any member (e.g. the coordinator's --bind).",
			Examples: []string{"qvd join node0:7946 --bind 0.0.0.0:7946 --cluster-key-file cluster.key"}},
			run: cmdJoin},
		{Command: cli.Command{Name: "launch", Synopsis: "qvd launch --nproc N [--nnodes M --node-rank R --master-addr HOST] [train flags]",
			About: "Runs an N-process job on this machine (or one machine's share of a multi-machine job).\nEverything from the first flag launch does not know on goes to the coordinator's qvd train.",
			Examples: []string{"qvd launch --nproc 4 -c fashion-mlp --out runs/mlp4",
				"qvd launch --nproc 8 --nnodes 2 --node-rank 0 --master-addr node0 -c fashion-cnn"}},
			run: cmdLaunch},
		{Command: cli.Command{Name: "status", Synopsis: "qvd status PEER|RUN_DIR [--cluster-key-file FILE] [--tls-ca FILE --tls-cert FILE --tls-key FILE]",
			About:    "Lists a cluster's members, joining through PEER as an observer; given a run directory,\nshows its job's generation, world and every elastic re-form (from metrics.jsonl).",
			Examples: []string{"qvd status node0:7946 --cluster-key-file cluster.key", "qvd status runs/mlp"}},
			run: cmdStatus},
		{Command: cli.Command{Name: "bench", Synopsis: "qvd bench allreduce|reducescatter|allgather|broadcast --nproc N [flags]",
			About:    "Measures a collective across N local processes as nccl-tests reports it: algbw, busbw\nand #wrong per size.",
			Examples: []string{"qvd bench allreduce --nproc 4", "qvd bench allgather --nproc 2 --sizes 1MiB,64MiB --dtype bf16 --transport tcp"},
			Hidden:   []string{"serve", "join", "bind", "grpc-bind", "advertise", "node-name"},
			Args:     slices.Sorted(maps.Keys(bench.Collectives))},
			run: cmdBench},
		{Command: cli.Command{Name: "gpus", Synopsis: "qvd gpus [--json] [--require]",
			About:    "Lists the GPUs NVML sees: memory, utilisation, temperature, power, driver and CUDA versions.",
			Examples: []string{"qvd gpus", "qvd gpus --json --require"}},
			run: noCtx(cmdGPUs)},
		{Command: cli.Command{Name: "keygen", Flagless: true, Synopsis: "qvd keygen > cluster.key",
			About:    "Prints a new random cluster key (hex).",
			Examples: []string{"qvd keygen > cluster.key"}},
			run: noCtx(cmdKeygen)},
		{Command: cli.Command{Name: "certs", Synopsis: "qvd certs --out DIR --hosts H1,H2,...",
			About:    "Makes a cluster CA (ca.pem, ca-key.pem) and, per host, HOST.pem and HOST-key.pem\nfor --tls-ca DIR/ca.pem --tls-cert DIR/HOST.pem --tls-key DIR/HOST-key.pem.\nWith ca.pem and ca-key.pem already in DIR, it adds hosts to that CA.",
			Examples: []string{"qvd certs --out certs --hosts node0,node1+10.0.0.5"}},
			run: noCtx(cmdCerts)},
		{Command: cli.Command{Name: "estimate", Synopsis: "qvd estimate (--params N | -c CONFIG) [--world N] [--stage S] [--offload none|cpu] [flags]",
			About: "Prints per-rank memory of ZeRO stages 0-2; with --recommend, a micro-batch and\naccumulation for --memory and --effective-batch.",
			Examples: []string{"qvd estimate --params 1.3e9 --world 8 --stage 2",
				"qvd estimate -c fashion-mlp --recommend --memory 24GiB --effective-batch 32"}},
			run: noCtx(cmdEstimate)},
		{Command: cli.Command{Name: "plot", Synopsis: "qvd plot METRICS.jsonl|RUN_DIR [-o PNG] [--csv FILE] [--title T]",
			About:    "Plots a run's metrics.jsonl (or its run directory) to a PNG.",
			Examples: []string{"qvd plot runs/mlp", "qvd plot runs/mlp/metrics.jsonl -o curves.png --csv metrics.csv"}},
			run: noCtx(cmdPlot)},
		{Command: cli.Command{Name: "eval", Synopsis: "qvd eval [-c CONFIG] --checkpoint RUN_DIR|CHECKPOINT_DIR|MODEL.safetensors [--data DIR] [--json FILE]",
			About: "Evaluates trained weights on the config's test set: prints accuracy, loss and the confusion\n" +
				"matrix (rows: true class), and with --json writes them as JSON. A run directory means its\n" +
				"newest checkpoint that verifies, as --resume auto picks it.",
			Examples: []string{"qvd eval -c fashion-mlp --checkpoint runs/mlp",
				"qvd eval -c fashion-cnn --checkpoint runs/cnn/checkpoints/step-00009380 --json eval.json"}},
			run: noCtx(cmdEval)},
		{Command: cli.Command{Name: "predict", Synopsis: "qvd predict [-c CONFIG] --checkpoint PATH [--top-k K] [--json] IMAGE...",
			About: "Prints the most probable classes, with their softmax probabilities, for PNG or JPEG images:\n" +
				"converted to the model's channels (grey or RGB), resized bilinearly to its input size and\n" +
				"normalised as in training. PATH is what qvd eval's --checkpoint takes.",
			Examples: []string{"qvd predict -c fashion-mlp --checkpoint runs/mlp shoe.png",
				"qvd predict -c fashion-cnn --checkpoint runs/cnn --top-k 5 --json a.png b.jpg"}},
			run: noCtx(cmdPredict)},
		{Command: cli.Command{Name: "dashboard", Synopsis: "qvd dashboard METRICS.jsonl|RUN_DIR|PEER [--addr HOST:PORT] [--peer PEER]",
			About: "Serves a live web page of a run's metrics.jsonl: loss, test accuracy, throughput, memory\n" +
				"by category with the phase peaks, memory per rank, the cluster's members and recent events\n" +
				"(re-forms, lost members, stops, skipped and OOM-skipped steps), updated every second. With\n" +
				"PEER (a member's gossip address) it joins the cluster as an observer, as qvd status does,\n" +
				"and shows the members' rank, step, generation, health and memory live.",
			Examples: []string{"qvd dashboard runs/mlp", "qvd dashboard 10.0.0.1:7946 --addr 0.0.0.0:8080",
				"qvd dashboard runs/mlp --peer 10.0.0.1:7946"}},
			run: cmdDashboard},
		{Command: cli.Command{Name: "config", Synopsis: "qvd config [-c CONFIG] [flags]",
			About:    "Prints the resolved configuration as YAML: defaults, the config, DeepSpeed JSON, flags.",
			Examples: []string{"qvd config -c fashion-mlp --zero-stage 2", "qvd config --deepspeed ds_config.json"}},
			run: noCtx(cmdConfig)},
		{Command: cli.Command{Name: "completion", Flagless: true, Synopsis: "qvd completion bash|zsh",
			About: "Prints a shell completion script for qvd's commands and their flags.", Args: []string{"bash", "zsh"},
			Examples: []string{"source <(qvd completion bash)",
				"qvd completion zsh > \"${fpath[1]}/_qvd\""}},
			run: noCtx(cmdCompletion)},
		{Command: cli.Command{Name: "version", Flagless: true, Synopsis: "qvd version",
			About: "Prints the version.", Examples: []string{"qvd version"}},
			run: noCtx(cmdVersion)},
		{Command: cli.Command{Name: "help", Flagless: true, Synopsis: "qvd help [COMMAND]",
			About: "Prints the overview, or a command's help.", Examples: []string{"qvd help", "qvd help train"}},
			run: noCtx(cmdHelp)},
	}
}

func lookupCommand(name string) (command, bool) {
	for _, c := range commands() {
		if c.Name == name {
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
	return command{Command: cli.Command{Name: strings.TrimPrefix(fs.Name(), "qvd "), Synopsis: fs.Name() + " [flags]"}}
}

func newFlagSet(name string) *flag.FlagSet { return cli.NewFlagSet("qvd " + name) }

// parseFlags parses args into fs. It reports false with the exit code when the command
// should stop: 0 after printing the help for -h/--help, exitUsage after a one-line error.
func parseFlags(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (int, bool) {
	return parsed(fs, cli.Parse(fs, commandOf(fs).Command, args, stdout), stderr)
}

// parseOneArg is parseFlags for a command with one positional argument (PEER, a path),
// before or after the flags.
func parseOneArg(fs *flag.FlagSet, args []string, stdout, stderr io.Writer) (string, int, bool) {
	arg, err := cli.ParseOneArg(fs, commandOf(fs).Command, args, stdout)
	code, ok := parsed(fs, err, stderr)
	return arg, code, ok
}

// parsed maps a cli parse error to parseFlags' results.
func parsed(fs *flag.FlagSet, err error, stderr io.Writer) (int, bool) {
	switch {
	case err == nil:
		return exitOK, true
	case errors.Is(err, flag.ErrHelp):
		return exitOK, false
	}
	return usageError(fs, stderr, "%v", err), false
}

// usageError prints "qvd CMD: message (see qvd CMD --help)" and returns exitUsage.
func usageError(fs *flag.FlagSet, stderr io.Writer, format string, a ...any) int {
	c := commandOf(fs)
	fmt.Fprintf(stderr, "qvd %s: %s (see qvd %s --help)\n", c.Name, fmt.Sprintf(format, a...), c.Name)
	return exitUsage
}

// flagsOf is c's FlagSet, got by running it with --help; nil for a command without flags.
func flagsOf(c command) *flag.FlagSet {
	if c.Flagless {
		return nil
	}
	col := &cli.Collector{Writer: io.Discard}
	c.run(context.Background(), []string{"--help"}, col, io.Discard)
	return col.FlagSet
}

func cmdVersion(_ []string, stdout, _ io.Writer) int {
	fmt.Fprintf(stdout, "qvd %s\n", version.Version)
	return exitOK
}

// commandHelp prints c's help and returns its exit code (0).
func commandHelp(c command, stdout, stderr io.Writer) int {
	if c.Flagless {
		cli.PrintHelp(stdout, c.Command, nil)
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

func cmdCompletion(args []string, stdout, stderr io.Writer) int {
	var cmds []cli.Command
	var names []string
	for _, c := range commands() {
		cmds, names = append(cmds, c.Command), append(names, c.Name)
	}
	cmds[slices.IndexFunc(cmds, func(c cli.Command) bool { return c.Name == "help" })].Args = names // help takes a command
	flags := func(c cli.Command) *flag.FlagSet { cc, _ := lookupCommand(c.Name); return flagsOf(cc) }
	if len(args) != 1 || errors.Is(cli.Completion(stdout, "qvd", args[0], cmds, flags), cli.ErrShell) {
		fmt.Fprintln(stderr, "qvd completion: give bash or zsh (see qvd completion --help)")
		return exitUsage
	}
	return exitOK
}
