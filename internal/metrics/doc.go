// Package metrics owns the per-step metrics file: the Record type written once per optimizer
// step and once per evaluation — and, less often, for an event (KindEvent: the group formed,
// a member lost, the micro-batch halved) and rank 0's view of the members (KindMembers) —
// the Writer that appends records to a JSON-lines file while a
// run is in progress, and the readers (ReadFile, WriteCSV) used by `qvd plot` and by users.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// Contract:
//   - The file holds one JSON object per line, in the order the records were written. A run
//     resumed from a checkpoint appends to the same file, so a step can appear more than once;
//     readers that need one value per step keep the last one.
//   - Readers skip kinds they do not know: later versions may add some.
//   - Non-finite floats (a NaN loss after an fp16 overflow, an infinite gradient norm) cannot be
//     written as JSON numbers. They are written as null and read back as NaN, so one bad step
//     never makes the whole file unreadable. The sign of an infinity is not preserved.
//   - Writer buffers records and flushes them at least once a second of wall time, every
//     flushEvery records, and on Flush and Close, so that `tail -f` follows a run closely
//     without a write(2) per step. Writer's methods are safe for concurrent use; the background
//     flush is a timer owned by the Writer and stopped by Close.
//   - ReadFile tolerates a truncated last line (what a killed run leaves behind); any other
//     malformed line is an error naming its line number. Create in append mode removes such a
//     truncated tail before appending, so a resumed run does not glue its first record onto it.
package metrics
