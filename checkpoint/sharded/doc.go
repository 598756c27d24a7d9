// Package sharded is qvd's distributed checkpoint protocol on top of package checkpoint:
// what a group of data-parallel ranks writes into one checkpoint directory, and how any
// group reads it back.
// It sits in the training layer of docs/architecture.md and takes the trainer's state through
// small interfaces: it must not import trainer, engine, zero, configs, job or cmd.
//
// It owns the meta.json schema of a training checkpoint ([Meta]), the names of the files in
// it ([ModelFile], [ShardFile]), which ranks write which optimizer-state shard ([Plan]), the
// three-phase save in which the ranks agree after each phase ([Save]), and the resume side:
// a [Source] that reads optimizer state by flat range out of shards written at any world
// size and ZeRO stage, and [LoadState], which streams it from rank 0 to every rank, each
// keeping its own range.
//
// Callers (package trainer) pass what the protocol needs as values and small interfaces: a
// [Comm] (a collective.Communicator fits), the shard bounds, writer and reader functions.
// Every collective here must be called by every rank of the group in the same order, as
// collective.Communicator requires; the functions document which ranks call them.
//
// It must not import trainer, engine or zero: it knows nothing of models or optimizers,
// only of flat float32 ranges and the files that hold them.
package sharded
