// Package tbevents writes and reads TensorBoard event files: a sequence of TFRecords, each
// holding one serialized tensorflow.Event protocol buffer.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// It owns three layers, each usable alone:
//   - The TFRecord framing (record.go): uint64 little-endian length, masked CRC-32C of the
//     length, the data, masked CRC-32C of the data. The mask is LevelDB's, which TensorFlow
//     adopted: "it is problematic to compute the CRC of a string that contains embedded CRCs".
//   - The subset of tensorflow/core/util/event.proto and framework/summary.proto that scalars
//     need (event.go), encoded by hand with protowire: Event{wall_time=1, step=2,
//     file_version=3, summary=5, session_log=7}, Summary{repeated Value value=1},
//     Value{tag=1, simple_value=2, tensor=8}. The decoder also reads the TF2 form of a scalar
//     (a rank-0 float tensor), so files written by tf.summary.scalar read back.
//   - Writer (writer.go), which names the file as TensorFlow does
//     (events.out.tfevents.<10-digit unix seconds>.<hostname>), writes the
//     Event{file_version: "brain.Event:2"} record first, and appends events.
//
// The trainer's metrics sink on rank 0 is the only writer in qvd; ReadFile and RecordReader
// exist for tests and tools. Writer's methods are safe for concurrent use; the encoders and
// decoders are pure functions.
//
// Reference data: testdata/ holds an event file written by TensorFlow, taken from the
// tensorflow/tensorboard repository, and the bytes of rustboard's TFRecord test (see
// testdata/README.md); the tests check that both parse and that Writer reproduces their
// records byte for byte.
package tbevents
