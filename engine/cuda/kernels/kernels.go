// Package kernels holds the CUDA C kernels of the CUDA backend (kernels.cu) and the PTX that
// nvcc makes of them (kernels.ptx, committed), so that building qvd needs no nvcc: the driver
// JIT-compiles the PTX for its GPU when engine/cuda loads the module. This package is plain Go
// and builds everywhere; only engine/cuda (build tag cuda) talks to the driver.
// It imports no other qvd package.
//
// After editing kernels.cu, run `go generate ./engine/cuda/kernels` and commit both files; a
// test fails while the PTX is older than the source.
package kernels

//go:generate sh gen.sh

import (
	_ "embed"
	"strings"
)

// PTX is the module engine/cuda loads: kernels.cu compiled for compute_80.
//
//go:embed kernels.ptx
var PTX string

// shaPrefix starts the line gen.sh puts before nvcc's output.
const shaPrefix = "// qvd-source-sha256: "

// SourceSHA256 is the hex sha256 of the kernels.cu that PTX was generated from ("" if the
// first line is missing).
var SourceSHA256 = sourceSHA256(PTX)

func sourceSHA256(ptx string) string {
	line, _, _ := strings.Cut(ptx, "\n")
	sum, ok := strings.CutPrefix(line, shaPrefix)
	if !ok {
		return ""
	}
	return strings.TrimSpace(sum)
}

// Types are the suffixes of the element types the kernels are instantiated for, as
// engine.DType's String gives them.
var Types = []string{"f32", "f16", "bf16"}

// Unary are the operations instantiated once per type: entry point op_T.
var Unary = []string{
	"fill", "add_bias", "relu", "relu_grad", "transpose01", "im2col", "col2im",
	"maxpool2", "maxpool2_scatter", "softmax_xent", "unscale_check", "sum_squares",
	// The transformer layers' operations.
	"axpby", "layer_norm", "layer_norm_grad", "layer_norm_params", "gelu", "gelu_grad", "dropout",
	"softmax", "softmax_grad", "patchify", "unpatchify", "batch_norm_stats", "batch_norm_apply",
	"batch_norm_grad",
}

// Binary are the operations instantiated for every pair of types: entry point op_A_B, where
// A and B are, in order, convert's and copy_rows' destination and source, sum_rows' and
// sum_cols' destination and source, and adamw's gradient and working-precision weights.
var Binary = []string{"convert", "sum_rows", "sum_cols", "adamw", "copy_rows"}

// FromF32 are the operations instantiated once per type T for a float (fp32) second operand:
// entry point op_T_f32. They finish a convolution from its GEMM's fp32 result, rounding once
// to T: col2im (dx from fp32 columns) and conv_out (y from the channel-major fp32 product and
// the bias).
var FromF32 = []string{"col2im", "conv_out"}

// Name is the entry point of op for the given type suffixes.
func Name(op string, types ...string) string {
	return op + "_" + strings.Join(types, "_")
}

// Names lists every entry point the module must have.
func Names() []string {
	var out []string
	for _, op := range Unary {
		for _, t := range Types {
			out = append(out, Name(op, t))
		}
	}
	for _, op := range Binary {
		for _, a := range Types {
			for _, b := range Types {
				out = append(out, Name(op, a, b))
			}
		}
	}
	for _, op := range FromF32 {
		for _, t := range Types {
			out = append(out, Name(op, t, "f32"))
		}
	}
	return out
}

// Entries lists the entry points (.entry directives) that PTX defines.
func Entries() []string {
	var out []string
	for _, line := range strings.Split(PTX, "\n") {
		rest, ok := strings.CutPrefix(strings.TrimSpace(line), ".visible .entry ")
		if !ok {
			continue
		}
		name, _, _ := strings.Cut(rest, "(")
		out = append(out, strings.TrimSpace(name))
	}
	return out
}
