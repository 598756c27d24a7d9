package main

import (
	"io"

	"github.com/qvd/qvd/infer"
)

func cmdPredict(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("predict")
	var f inferenceFlags
	f.register(fs)
	topK := fs.Int("top-k", 3, "how many of the most probable classes to print per image")
	asJSON := fs.Bool("json", false, "print the predictions as JSON lines, one per image")
	// Images and flags may come in any order: flag parsing stops at the first image, so go on
	// after it.
	var images []string
	for rest := args; ; {
		if code, ok := parseFlags(fs, rest, stdout, stderr); !ok {
			return code
		}
		if fs.NArg() == 0 {
			break
		}
		images, rest = append(images, fs.Arg(0)), fs.Args()[1:]
	}
	if len(images) == 0 {
		return usageError(fs, stderr, "give one or more PNG or JPEG images")
	}
	if *topK < 1 {
		return usageError(fs, stderr, "--top-k must be >= 1, got %d", *topK)
	}
	// The model's input shape and classes come from the config, the checkpoint or the
	// weights, never from the dataset, which need not be on this machine.
	m, err := infer.LoadModel(f.options(0, stderr))
	if err != nil {
		return inferenceFailed("predict", stderr, err)
	}
	preds, err := m.Predict(images, *topK)
	if err != nil {
		return inferenceFailed("predict", stderr, err)
	}
	for _, p := range preds {
		if err := p.Print(stdout, *asJSON); err != nil {
			return inferenceFailed("predict", stderr, err)
		}
	}
	return exitOK
}
