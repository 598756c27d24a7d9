// Package checkpoint writes and reads qvd's training checkpoints: tensors in the safetensors
// format, and checkpoint directories that are committed atomically and verified on open.
// A leaf of docs/architecture.md: it must not import any qvd package outside internal/ (the
// distributed protocol over it is checkpoint/sharded).
//
// # Safetensors
//
// [WriteSafetensors] and [ParseSafetensors] implement the file format of Hugging Face's
// safetensors library, so that `safetensors.torch.load_file("model.safetensors")` loads the
// weights qvd writes, and qvd can read F32 tensors that PyTorch wrote:
//
//	8 bytes   N, little-endian uint64: length of the header
//	N bytes   UTF-8 JSON header, padded with spaces so that 8+N is a multiple of 8
//	rest      data buffer: the tensors' bytes, little-endian, back to back
//
// The header maps each tensor name to {"dtype": "F32", "shape": [d0, ...], "data_offsets":
// [begin, end]} (offsets relative to the start of the data buffer), plus an optional
// "__metadata__" object of string to string. The parser enforces what the reference
// implementation enforces on load: a known dtype, end-begin equal to the element count times
// the dtype's size, and tensors that are contiguous, non-overlapping and cover the whole data
// buffer with no trailing bytes. It never panics, whatever the input. Only F32 is written and
// decoded; other dtypes parse (so a file can be inspected) but decoding them returns
// [ErrUnsupportedDtype].
//
// # Checkpoint directories
//
// A checkpoint is a directory <dir>/step-%08d holding files written by the caller and a
// meta.json written by this package:
//
//	{
//	  "format": "qvd-checkpoint",
//	  "version": 2,
//	  "run_id": "20261124T101500-3f9a2c1b",      // absent when the directory records no run
//	  "step": 400,
//	  "created": "2025-01-02T03:04:05Z",          // RFC 3339, UTC
//	  "files": [                                   // sorted by name
//	    {"name": "model.safetensors", "size": 1234, "sha256": "<64 hex digits>"},
//	    ...
//	  ],
//	  "meta": <the caller's value, any JSON>,
//	  "checksum": "sha256:<64 hex digits>"
//	}
//
// The checksum covers every other value, the caller's metadata included: it is the SHA-256
// of the compact JSON of the fields above in this order, with "meta" re-encoded with sorted
// keys. A meta.json edited by hand or damaged on disk is therefore corrupt like a damaged
// tensor file, and a resume never continues from a step, data position or file list that the
// run did not write. Version 1 files, from before the checksum, are still read.
//
// Saving has two phases so that several writers can fill one checkpoint: [Manager.Begin]
// creates a temporary directory <dir>/.tmp-step-%08d-<run id>-<pid>-<random>, unique to the
// save, and [Manager.BeginShared] <dir>/.tmp-step-%08d-<run id>-shared, which the other ranks
// of a job compute from the directory's run id; files are written into it
// with [Pending.WriteFile] (or [WriteFileIn] by another process, which reports the returned
// [FileInfo] to the committer); [Pending.Commit] writes meta.json last and renames the
// directory into place. Every file, meta.json and both directories are fsynced before and
// after the rename, so a crash at any moment leaves every previously committed checkpoint
// intact; a step-%08d directory is either absent or complete. Leftover temporary
// directories are ignored by [Manager.List] and [Latest], and the run's own are removed by a
// later commit.
//
// Saving a step that already has a checkpoint replaces it: the old directory is renamed
// aside (.old-step-%08d-<random>), the new one renamed in, then the old one removed. A crash
// between the two renames leaves no step-%08d directory for that step (both copies remain on
// disk under hidden names), so [Latest] falls back to the previous step.
//
// After a commit, the run's checkpoints older than its newest keep valid ones are removed
// (never the one just written). Only checkpoints that verify count: a corrupt one is kept
// while it is newer than the oldest one kept, so damage never costs a good checkpoint; each
// is verified once per Manager (the ones it committed are trusted). Removal renames a
// directory aside before deleting it, so an interrupted removal never leaves a half-deleted
// step-%08d directory behind.
//
// [Open] verifies every file listed in meta.json (existence, size, SHA-256) before returning;
// a failure is an error that matches [ErrCorrupt] and names the checkpoint and the file.
// [Latest] returns the newest checkpoint of the run that verifies, reporting each one it
// skipped, and [Resolve] implements the trainer's --resume flag on top of it.
//
// # Runs
//
// A checkpoint directory may record the run its checkpoints belong to in the file run-id
// ([RunIDFile]; package rundir writes it when a run starts). A [Manager] stamps that run id
// into every checkpoint it commits; [Latest] (and so --resume auto) skips checkpoints of
// other runs ([ErrOtherRun]), and pruning never removes them. Checkpoints without a run id,
// written before run ids existed, belong to any run.
//
// # Concurrency
//
// A [Pending] is safe for concurrent WriteFile calls with distinct names. Only one process
// should commit into a given checkpoint directory at a time (in a multi-rank run: rank 0,
// after a barrier), because commits prune each other's old checkpoints; package rundir's lock
// keeps a second run out of it. [Checkpoint] values are read-only and safe for concurrent
// use. This package logs nothing: conditions worth a log line are returned to the caller
// ([Latest]'s skipped list, [ErrPrune]).
package checkpoint
