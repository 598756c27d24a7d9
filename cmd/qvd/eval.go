package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/infer"
)

// inferenceFlags are the flags qvd eval and qvd predict share (infer.Options).
type inferenceFlags struct {
	config, checkpoint, dataPath string
}

func (f *inferenceFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.config, "c", "", "config: a YAML file, or the name of an embedded config ("+fmt.Sprint(configs.Embedded())+"); default: the config the checkpoint was trained with (its meta.json). Its model section must describe the checkpoint's model")
	fs.StringVar(&f.config, "config", "", "same as -c")
	fs.StringVar(&f.checkpoint, "checkpoint", "", "the weights: a run directory (its newest valid checkpoint), a checkpoint directory, or a model.safetensors file (which needs -c)")
	fs.StringVar(&f.dataPath, "data", "", "dataset directory (data.path)")
}

func (f inferenceFlags) options(testSubset int, stderr io.Writer) infer.Options {
	return infer.Options{Config: f.config, Checkpoint: f.checkpoint, DataPath: f.dataPath, TestSubset: testSubset,
		Warn: func(s string) { fmt.Fprintf(stderr, "warning: %s\n", s) }}
}

func cmdEval(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("eval")
	var f inferenceFlags
	f.register(fs)
	jsonPath := fs.String("json", "", "also write accuracy, loss and the confusion matrix as JSON to this file")
	subset := fs.Int("test-subset", 0, "evaluate on the first N test samples only (data.test_subset)")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		return usageError(fs, stderr, "unexpected argument %q (flags only)", fs.Arg(0))
	}
	if *subset < 0 {
		return usageError(fs, stderr, "--test-subset must be >= 0, got %d", *subset)
	}
	rep, err := infer.Eval(f.options(*subset, stderr))
	if err != nil {
		return inferenceFailed("eval", stderr, err)
	}
	rep.Print(stdout)
	if *jsonPath != "" {
		if err := rep.WriteJSON(*jsonPath); err != nil {
			fmt.Fprintf(stderr, "qvd eval: writing --json: %v\n", err)
			return exitFailure
		}
	}
	return exitOK
}

// inferenceFailed prints err for qvd CMD and returns its exit code: exitUsage for a bad
// flag or config, exitFailure otherwise (a missing or corrupt checkpoint, a mismatch).
func inferenceFailed(cmd string, stderr io.Writer, err error) int {
	msg := strings.ReplaceAll(err.Error(), "\n", "\n  ")
	fmt.Fprintf(stderr, "qvd %s: %s\n", cmd, msg)
	if errors.Is(err, configs.ErrInvalid) {
		return exitUsage
	}
	return exitFailure
}
