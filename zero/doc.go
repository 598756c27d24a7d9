// Package zero partitions a model's training state across the ranks of a data-parallel group
// the way ZeRO does (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training
// Trillion Parameter Models"), and runs one rank's part of a training step:
// It sits in the engines layer of docs/architecture.md: it must not import trainer, configs,
// job or cmd.
//
//   - stage 0 (DDP): every rank holds everything; gradients are all-reduced and every rank
//     steps the whole optimizer;
//   - stage 1: gradients are all-reduced, but each rank keeps fp32 master weights and
//     optimizer moments only for its shard, steps its shard, and the updated parameters are
//     all-gathered in the working precision (with overlap_comm, under the next forward
//     pass, which waits for each layer's parameters: Engine.WaitParams);
//   - stage 2: additionally, each micro-batch's gradient is reduce-scattered bucket by bucket
//     as soon as it is computed, and each rank keeps only its shard of the gradient
//     (accumulated across micro-batches in the shard).
//
// Layout is pure arithmetic: the flat parameter space split into contiguous, aligned shards by
// flat offset. Because shards are defined by offsets, not by tensors, a checkpoint written at
// N ranks can be re-split at M ranks (the trainer's restore reads whatever old shards overlap
// each new one).
//
// Engine owns a rank's gradient buffers, master weights, its optimizer (over its shard) and the
// collectives of a step; the trainer drives it. With offload_optimizer.device = cpu the master
// weights, gradient shard and optimizer state live in host memory and the step runs there; the
// gradient moves to the host and the parameters back through an offload.Stream. On the CPU
// engine both sides are the same RAM, but the transfers and the accounting (Memory) are the
// ones the GPU engine uses. Estimate predicts Memory without allocating anything.
package zero
