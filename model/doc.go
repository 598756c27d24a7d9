// Package model builds qvd's neural networks as gorgonia graphs over one flat parameter buffer.
// It must not import engine, zero, trainer or anything above them (docs/architecture.md): the
// engines depend on the model, never the reverse.
//
// Every trainable tensor is a view (tensor.WithBacking) of a slice of a single []float32 whose
// arrangement is described by a Layout: names, shapes and flat offsets, each tensor aligned to
// Align elements. That flat space is what the optimizer steps, what ZeRO partitions into
// per-rank shards by offset, and what checkpoints save; the graph never owns its weights.
//
// A Net holds two compiled graphs over the same parameter views: a training graph at the
// micro-batch size (forward, cross-entropy loss times a loss-scale input, and gorgonia's
// symbolic gradients) and a forward-only evaluation graph at the evaluation batch size.
// ForwardBackward adds the micro-batch gradient, rounded to the working precision, into a
// caller-owned flat gradient buffer with the same layout as the parameters, which is how
// gradient accumulation and the later all-reduce see it.
//
// With Options.Segments > 1 (activation recomputation, recompute.go) the training graph is
// replaced by one forward graph and one forward+backward graph per segment of layers; the
// step keeps only segment inputs between segments and recomputes each segment in the
// backward pass. Loss and gradients are bit for bit those of the single graph, and the
// gradients still stream out in flat-offset order. Building such a Net turns off the tensor
// package's *Dense pool for the process (see poolOnce).
//
// A Net is not safe for concurrent use: the trainer owns it and calls it from one goroutine.
package model
