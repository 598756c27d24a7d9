// Package optim implements the optimizers that update qvd's fp32 master weights — SGD (with
// momentum and Nesterov), Adam and AdamW, and Adam and AdamW with 8-bit block-wise quantised
// moments (adam8bit, adamw8bit) — over flat []float32 slices, stepped in parallel on the
// offload.Pool's threads. It is the one place that knows each optimizer's state size
// (StateElems, QuantizedStateBytes). It sits in the parts layer of docs/architecture.md: it
// must not import zero, engine, trainer or anything above them.
//
// # Contract
//
// An Optimizer is built for a fixed length n: the whole flat parameter space, or one rank's
// contiguous ZeRO shard [lo,hi) of it (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
// Training Trillion Parameter Models", 2020). It owns its state buffers (Adam's first and
// second moments, SGD's momentum buffer, the 8-bit optimizers' codes and per-block scales),
// mapped once in New as internal/arena blocks of category arena.Optimizer — outside the Go
// heap, 2 MiB-aligned and advised MADV_HUGEPAGE — and unmapped by Close, and the worker
// goroutines of its Pool, started in New and stopped by Close. The views State returns are
// valid until Close; Step after Close panics. The caller owns the parameter and gradient slices
// and passes them to every Step; the optimizer keeps no reference to them between calls.
// Because the state is just flat host memory stepped on the CPU, the same code is the host half
// of ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training",
// 2021).
//
// The update rules follow torch.optim (SGD, Adam, AdamW) operation for operation in float32,
// with bias corrections computed once per step in float64; see the Optimizer docs for the
// formulas. Explicit float32 conversions pin the rounding of every product so that no platform
// fuses them into FMAs, which keeps results bit-identical across machines, thread counts and
// runs: each element's update depends only on that element.
//
// The 8-bit optimizers keep each moment as one byte per parameter plus a float32 scale per
// QuantBlock parameters (Dettmers et al., "8-bit Optimizers via Block-wise Quantization",
// 2022), blocks counted from the start of the optimizer's own buffer, so each ZeRO shard is
// quantised on its own. They expose their state through StateCodec in float32, so their
// checkpoints hold the same exp_avg and exp_avg_sq as adam's and reshard freely.
//
// Step does not allocate and starts no goroutines: it runs on the Pool's persistent workers.
//
// # Concurrency
//
// An Optimizer is driven by one goroutine (the trainer's step loop); only Steps may be called
// concurrently with the others.
package optim
