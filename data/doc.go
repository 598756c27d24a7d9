// Package data opens a labelled image dataset, decides which samples each rank trains on, and
// fills caller-owned batches with normalised (and, for training, augmented) pixels.
// A leaf of docs/architecture.md: it must not import any qvd package outside internal/.
//
// What it owns:
//
//   - Formats (Config.Format): idx, Fashion-MNIST or MNIST's IDX files (below); image-folder,
//     PNG and JPEG files under train/CLASS/ and test/CLASS/ (folder.go), listed at Open and
//     decoded, converted and resized only when a batch needs them, so the images are never
//     all in memory; safetensors, images and labels tensors (safetensors.go). A Dataset
//     reports its sample shape and classes (Shape, Describe), which size the model.
//   - Splits (split.go): OpenSplits also returns a validation split: the training samples
//     data.val_split holds out (HoldOut, drawn by Options.Seed alone, so every rank and every
//     resume holds out the same ones), or an image folder's val/. A held-out split and the
//     training samples left share the loaded storage through a row map; only labels are
//     copied. Count sizes the splits from headers and file lists, without loading them.
//   - Bad samples: an image-folder file that cannot be decoded fails the fill naming it
//     (data.on_error: fail) or is skipped, its row taking the next readable sample so every
//     rank agrees, reported once through Options.Warn and counted by Skipped.
//   - Augmentation (augment.go): FillAugmented crops and flips training samples as drawn from
//     (seed, epoch, sample index), so it does not depend on the rank, the world size or a
//     resume.
//   - Reading: Load reads the four standard IDX files from a directory (gzip or raw) into a
//     Dataset that keeps pixels as uint8, four times smaller than float32; normalisation happens
//     when a batch is filled. Files are checked, not trusted: a bad magic, a truncated or
//     corrupt gzip stream, dimensions that disagree with the payload, absurd dimensions, counts
//     that disagree between images and labels, and labels out of range are all errors wrapping
//     ErrCorrupt and naming the file. A header is never trusted to size an allocation on its
//     own, so a lying file cannot make the loader allocate far beyond the data it holds.
//   - Sampling: Permutation, MicroBatch and StepsPerEpoch follow PyTorch's DistributedSampler
//     with drop_last, arranged so that the training run does not depend on the number of
//     ranks. Every rank computes the same epoch permutation from (seed, epoch); a step with
//     global batch world·m·k consumes the next world·m·k positions; and micro-batch j of the
//     step, taken over all ranks together, is exactly micro-batch j of size world·m that a
//     single worker would draw. With gradients averaged over ranks, N workers therefore
//     reproduce one worker's run.
//   - Batches: Fill and FillRange write normalised pixels and labels into a Batch allocated
//     once by NewBatch; they allocate nothing, so the step loop stays allocation-free.
//   - Prefetch: a Prefetcher fills the micro-batches of a Sequence (micro-batch k holds the
//     samples Indices(k)) on its own goroutine into a ring of Config.Prefetch+1 batches, so
//     normalising overlaps compute; the consumer gets exactly Fill's batches, in order, and
//     Fill's errors in order. It owns its goroutine; Stop and Close end it.
//
// Memory: Load keeps one uint8 copy of each split, decoded straight into its final buffer
// (sized by the header, or by a gzip trailer that agrees with it); with a subset only the
// subset's pixels are ever held. Nothing converts a split to float32: only the batches are.
//
// The trainer calls Open (or Load) once at startup, Permutation once per epoch, and per micro-batch
// either MicroBatch and FillAugmented or, with data.prefetch > 0, a Prefetcher's Next over the rest of
// the epoch; FillRange during evaluation.
//
// Concurrency: a Dataset is read-only after Load (but for its log of skipped files, which a
// mutex guards), so any number of goroutines may Fill from
// one Dataset at once as long as each fills its own Batch. Permutation, MicroBatch and
// StepsPerEpoch are pure functions. A Prefetcher belongs to one consumer goroutine.
package data
