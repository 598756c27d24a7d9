package main

import (
	"fmt"
	"io"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/job"
	"github.com/qvd/qvd/job/estimate"
)

// cmdEstimate prints per-rank model-state memory for ZeRO stages 0-2 with and without
// offload, and recommends a micro-batch and accumulation for a memory budget (job/estimate).
func cmdEstimate(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("estimate")
	var r estimate.Request
	fs.StringVar(&r.Config, "c", "", "take the parameter count, precision, optimizer and ZeRO settings from this config (a file or an embedded name)")
	fs.StringVar(&r.Params, "params", "", "parameter count Ψ, e.g. 1.3e9 or 350M (instead of -c)")
	fs.IntVar(&r.World, "world", 1, "ranks (GPUs or processes) N")
	fs.IntVar(&r.Stage, "stage", -1, "ZeRO stage to mark in the table and use for --recommend (default: the config's, or 2)")
	fs.StringVar(&r.Offload, "offload", "", "none or cpu (default: the config's, or none)")
	fs.StringVar(&r.Precision, "precision", "", "fp32, fp16 or bf16 (default: the config's, or fp16)")
	fs.StringVar(&r.Optimizer, "optimizer", "", "adamw, adam, sgd, adamw8bit or adam8bit (default: the config's, or adamw)")
	fs.IntVar(&r.Accum, "accum", 0, "micro-batches per step (default: the config's, or 1); at stage 1 without accumulation the gradient is partitioned as at stage 2")
	fs.IntVar(&r.MicroBatch, "micro-batch", 0, "micro-batch for the peak estimate (default: the config's)")
	fs.Int64Var(&r.MaxSteps, "max-steps", 0, "steps the run takes, for the dataset pages it reads (default: the config's epochs and max_steps)")
	fs.IntVar(&r.TestSubset, "test-subset", 0, "test samples the run evaluates (default: the config's)")
	fs.BoolVar(&r.Recommend, "recommend", false, "recommend micro-batch and accumulation steps for --memory and --effective-batch")
	fs.StringVar(&r.Memory, "memory", "", "memory budget per rank for --recommend, e.g. 24GiB, 16GB, 512MiB")
	fs.IntVar(&r.EffectiveBatch, "effective-batch", 0, "global batch (micro × accum × world) to keep, for --recommend")
	fs.StringVar(&r.ActivationBytes, "activation-bytes", "", "activation memory per sample for --recommend, e.g. 1.5MiB (default: measured on the -c model)")
	fs.BoolVar(&r.Exact, "bytes", false, "print sizes in bytes")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	err := fmt.Errorf("unexpected argument %q", fs.Arg(0))
	if fs.NArg() == 0 {
		err = r.Run(stdout, job.DataShape, func() (engine.Device, error) { return job.CPUDevice(nil, 0, 0) })
	}
	if err != nil {
		fmt.Fprintf(stderr, "qvd estimate: %v\n", err)
		return exitUsage
	}
	return exitOK
}
