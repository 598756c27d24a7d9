// Samplecheck checks the sample logs of an elastic run (QVD_SAMPLE_LOG=DIR: every training
// process appends DIR/samples-<pid>.jsonl): across re-forms and restarts, each epoch must
// train every sample of its steps exactly once. It prints a summary and exits 1 on a
// violation, 2 on bad input.
//
//	go run ./scripts/samplecheck [-epochs N] [-global-batch B] [-steps-per-epoch S] [-train-size N] DIR
package main

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
)

func main() {
	var want Want
	flag.IntVar(&want.Epochs, "epochs", 0, "epochs the run trained (0: not checked)")
	flag.IntVar(&want.GlobalBatch, "global-batch", 0, "samples per step (0: step 1's)")
	flag.IntVar(&want.StepsPerEpoch, "steps-per-epoch", 0, "steps per epoch (0: the first epoch's)")
	flag.IntVar(&want.TrainSize, "train-size", 0, "training samples: indices must be below it (0: not checked)")
	flag.Usage = func() {
		fmt.Fprintln(flag.CommandLine.Output(), "usage: samplecheck [flags] DIR (the QVD_SAMPLE_LOG directory)")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	files, err := filepath.Glob(filepath.Join(flag.Arg(0), "samples-*.jsonl"))
	if err == nil && len(files) == 0 {
		err = fmt.Errorf("no samples-*.jsonl in %s", flag.Arg(0))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "samplecheck:", err)
		os.Exit(2)
	}
	var all []Line
	cut := 0
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			fmt.Fprintln(os.Stderr, "samplecheck:", err)
			os.Exit(2)
		}
		lines, c, err := Read(f, name)
		f.Close()
		if err != nil {
			fmt.Fprintln(os.Stderr, "samplecheck:", err)
			os.Exit(2)
		}
		all, cut = append(all, lines...), cut+c
	}
	s := Check(all, want)
	fmt.Printf("samplecheck: %d files, %d lines", len(files), len(all))
	if cut > 0 {
		fmt.Printf(" (%d cut short at the end, skipped)", cut)
	}
	fmt.Println()
	fmt.Print(s)
	if len(s.Problems) > 0 {
		os.Exit(1)
	}
}
