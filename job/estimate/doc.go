// Package estimate is `qvd estimate`: per-rank model-state memory for every ZeRO stage and
// offload choice in the form of DeepSpeed's estimate_zero2_model_states_mem_needs (the
// arithmetic is zero.Estimate's), the peak resident memory of a rank of the native CPU engine
// (model states, measured activations, the dataset pages the run touches, the runtime), and a
// micro-batch and accumulation for a memory budget (zero.Recommend). It also measures
// activation memory per sample, which train.micro_batch: auto uses.
//
// Request.Run is the whole command, from the values of its flags (errors name them).
// It writes tables to the io.Writer it is given and returns errors; it reads no flags and no
// environment. It must not import cmd/qvd or the job package (job imports it).
package estimate
