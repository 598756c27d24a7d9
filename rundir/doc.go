// Package rundir gives a training run ownership of its run directory, so that two runs never
// mix their checkpoints, metrics or logs.
// It must not import engine, zero, trainer or anything above them (docs/architecture.md).
//
// [Open] is called once per run, before anything is written, by the process that writes the
// metrics and commits the checkpoints (rank 0: `qvd train`, the coordinator of a `qvd launch`
// or a SLURM job). It
//
//   - locks the run directory, and checkpoint.dir when it lies elsewhere: flock(2) on
//     <dir>/.qvd.lock, which records the holder's pid, host and start time. A second run is
//     refused with an error naming the holder ([ErrLocked]). The kernel drops the flock when
//     the holder dies, however it dies; the record it leaves is then stale, and a lock whose
//     recorded process of this host no longer runs is taken over and reported in
//     [Run.Stale]. A record naming another host, or a process still running, is honoured.
//   - refuses a fresh start in a directory that holds another run's checkpoints or metrics
//     ([ErrRunExists]) unless told to resume it or to overwrite it; overwriting moves the old
//     contents to <dir>.old-<UTC time> ([Run.MovedAside]) and never deletes anything.
//   - decides the run id: new for a fresh start, kept on a resume. It is recorded in
//     checkpoint.dir (checkpoint.RunIDFile), where checkpoint.Manager stamps it into every
//     checkpoint and checkpoint.Latest resumes only that run's checkpoints.
//
// The other processes of a job write their shards into checkpoint.dir under rank 0's lock;
// they never open the run directory themselves, except that in an elastic job the process
// that becomes rank 0 after the first one died takes over its lock with [Acquire] (the
// kernel released it) to go on appending to metrics.jsonl. [Run.Close] releases the locks; it is safe to
// call twice. This package logs nothing: what is worth a log line is in the returned [Run].
package rundir
