package memory

import "errors"

// ErrOutOfMemory is what an allocation failure inside a micro-batch reports (the GPU
// engine's allocator wraps it around the device's out-of-memory error; tests inject it). The
// trainer skips such a micro-batch instead of failing the run, and after a few in a row
// halves the micro-batch.
var ErrOutOfMemory = errors.New("out of memory")
