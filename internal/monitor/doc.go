// Package monitor owns the scalar monitors that rank 0 writes beside metrics.jsonl: TensorBoard
// event files (package tbevents) and DeepSpeed's csv_monitor layout, one CSV file per scalar.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// Scalars maps a metrics.Record to the scalars both monitors write (the tags are listed
// there); Sink writes each record to the enabled monitors. package job opens a Sink on rank 0 and
// forwards every record the trainer emits (one per optimizer step and one per evaluation).
//
// A fresh run replaces the files of the run it replaces in the same directories (event files
// are removed, the CSV files it writes are truncated), as metrics.jsonl is truncated; a run
// resumed from a checkpoint appends (a new event file beside the old ones, starting with a
// SessionLog START at the first step it writes, so TensorBoard's Python loader drops the old
// run's points from that step on). Sink's methods are safe for concurrent use; files are flushed at most
// flushInterval after a write when writes keep coming, and on Close.
package monitor
