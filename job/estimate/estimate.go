package estimate

import (
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/optim"
	"github.com/qvd/qvd/zero"
)

// Input is what the estimate knows of a job: from a config, or from a bare parameter count.
type Input struct {
	Name         string // the model, for the table's header
	Elems, World int    // flat parameter space Ψ, ranks
	Stage        int    // the job's ZeRO stage, marked in the table
	Offload      bool   // the job's offload_optimizer
	Format       half.Format
	Optimizer    optim.Config // Type and Momentum size its state
	Bucket       int64        // zero_optimization.reduce_bucket_size (0: auto)
	Accum        int
	// Exact prints sizes as plain byte counts, in tables and errors (qvd estimate --bytes).
	Exact bool
}

// Job is in's model states for zero.Estimate; an unknown optimizer is an error.
func (in Input) Job() (zero.Job, error) {
	state, err := optim.StateElems(in.Optimizer)
	if err != nil {
		return zero.Job{}, err
	}
	return zero.Job{Elems: in.Elems, World: in.World, Stage: in.Stage, Offload: in.Offload, FP32: in.Format == half.FP32,
		StateElems: state, Quantized: optim.QuantizedState(in.Optimizer), ReduceBucket: in.Bucket, Accum: in.Accum}, nil
}

// states is the model states of the job's own stage and offload on the CPU engine (float32).
func (in Input) states() (zero.Spec, error) {
	j, err := in.Job()
	return j.Spec(in.Stage, in.Offload, 4), err
}

// Bytes formats b as in's tables do.
func (in Input) Bytes(b int64) string { return FormatBytes(b, in.Exact) }

// WriteTable prints both accountings for every stage and offload setting.
func (in Input) WriteTable(w io.Writer) error {
	j, err := in.Job()
	if err != nil {
		return err
	}
	f := in.Format
	fmt.Fprintf(w, "Estimated memory for model states (parameters, gradients, master weights, optimizer state) per rank:\n")
	fmt.Fprintf(w, "HW: %d rank(s).  SW: %s, Ψ = %d elements, %s, %s.\n\n", in.World, in.Name, in.Elems, f, in.Optimizer.Type)
	tw := tabwriter.NewWriter(w, 2, 8, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "\tper device\tper host\tqvd CPU engine\t  options\t  ZeRO formula (%d-byte elements)\t\n", f.Bytes())
	for stage := 0; stage <= 2; stage++ {
		for _, off := range []bool{false, true} {
			gpu, err := zero.Estimate(j.Spec(stage, off, f.Bytes()))
			if err != nil {
				return err
			}
			cpu, err := zero.Estimate(j.Spec(stage, off, 4))
			if err != nil {
				return err
			}
			mark := " "
			if stage == in.Stage && off == in.Offload {
				mark = "*"
			}
			offS := "none"
			if off {
				offS = "cpu"
			}
			fs := stage
			if zero.GradPartitioned(stage, in.Accum) {
				fs = 2 // stage 1 without accumulation holds what stage 2 does
			}
			formula := zero.PaperFormula(fs, off)
			if f == half.FP32 || j.StateElems != 2 || j.Quantized {
				formula = "-"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t  stage=%d offload_optimizer=%s\t  %s\t\n", mark, in.Bytes(gpu.Device.Total()), in.Bytes(gpu.Host.Total()),
				in.Bytes(cpu.Total()), stage, offS, formula)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nper device / per host: a GPU engine storing %s in %d bytes (the staging buckets included);\n"+
		"qvd CPU engine: what `qvd train` allocates on this machine (every format stored as float32, device and host\n"+
		"being the same RAM), on the rank with the largest shard. * marks stage %d, offload %v. Activations are extra.\n",
		f, f.Bytes(), in.Stage, in.Offload)
	return nil
}

// Usable is what a budget leaves after memory.Headroom, for model states and activations.
func Usable(budget int64) int64 { return int64(float64(budget) * (1 - memory.Headroom)) }

// Recommend picks the largest micro-batch that fits the budget less the headroom and the
// model states (of the CPU engine, at the job's stage and offload) and divides the per-rank
// batch, so the effective batch is kept exactly (zero.Recommend). Its errors give the figures.
func (in Input) Recommend(budget, effective, perSample int64) (zero.Recommendation, error) {
	s, err := in.states()
	if err != nil {
		return zero.Recommendation{}, err
	}
	r, err := zero.Recommend(s, Usable(budget), effective, perSample)
	switch {
	case errors.Is(err, zero.ErrStatesTooLarge):
		return r, fmt.Errorf("the model states alone need %s, more than the %s usable of the %s budget; try a higher stage, offload or more ranks",
			in.Bytes(r.States), in.Bytes(r.Usable), in.Bytes(budget))
	case errors.Is(err, zero.ErrSampleTooLarge):
		return r, fmt.Errorf("one sample's activations (%s) do not fit in the %s left after the model states", in.Bytes(perSample), in.Bytes(r.Usable-r.States))
	}
	return r, err
}

// WriteRecommendation prints r for a budget per rank and an effective batch, with where the
// activation bytes per sample came from.
func (in Input) WriteRecommendation(w io.Writer, r zero.Recommendation, budget, effective, perSample int64, source string) {
	fmt.Fprintf(w, "\nRecommendation for %s per rank, effective batch %d, %d rank(s), stage %d%s:\n",
		in.Bytes(budget), effective, in.World, in.Stage, map[bool]string{true: " + offload", false: ""}[in.Offload])
	fmt.Fprintf(w, "  activations: %s per sample (%s)\n", in.Bytes(perSample), source)
	fmt.Fprintf(w, "  model states (qvd CPU engine): %s; usable after %.0f%% headroom: %s; room for %d samples per micro-batch\n",
		in.Bytes(r.States), memory.Headroom*100, in.Bytes(r.Usable), r.MaxMicro)
	fmt.Fprintf(w, "  micro_batch: %d\n  accum: %d\n  (%d × %d × %d = %d; peak ≈ %s)\n",
		r.Micro, r.Accum, r.Micro, r.Accum, in.World, effective, in.Bytes(r.States+r.Micro*perSample))
	fmt.Fprintf(w, "  qvd train -c CONFIG --micro-batch %d --accum %d\n", r.Micro, r.Accum)
}

// ParseCount parses a parameter count: 1.3e9, 350M, 7B, 125000.
func ParseCount(s string) (float64, error) {
	s = strings.TrimSpace(s)
	mul := 1.0
	if n := len(s); n > 0 {
		switch s[n-1] {
		case 'K', 'k':
			mul, s = 1e3, s[:n-1]
		case 'M', 'm':
			mul, s = 1e6, s[:n-1]
		case 'B', 'b', 'G', 'g':
			mul, s = 1e9, s[:n-1]
		case 'T', 't':
			mul, s = 1e12, s[:n-1]
		}
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(v) || v*mul < 1 || v*mul > 1e15 {
		return 0, fmt.Errorf("%q is not a parameter count between 1 and 1e15", s)
	}
	return math.Round(v * mul), nil
}

// ParseBytes parses 24GiB, 16GB, 512MiB, 1.5MiB, 1048576 (memory.ParseBytes).
func ParseBytes(s string) (int64, error) {
	b, err := memory.ParseBytes(s)
	return int64(b), err
}

// FormatBytes is b in binary units (memstat.FormatBytes, negative values too), or with exact
// the plain count.
func FormatBytes(b int64, exact bool) string {
	switch {
	case exact:
		return strconv.FormatInt(b, 10)
	case b < 0:
		return "-" + memstat.FormatBytes(uint64(-b))
	}
	return memstat.FormatBytes(uint64(b))
}

// Human is a parameter count for the table's header: 1.30B, 350.0M, 125000.
func Human(n float64) string {
	switch {
	case n >= 1e9:
		return fmt.Sprintf("%.2fB", n/1e9)
	case n >= 1e6:
		return fmt.Sprintf("%.1fM", n/1e6)
	}
	return strconv.FormatFloat(n, 'f', -1, 64)
}
