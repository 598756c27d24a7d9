// Package plot renders a metrics file (see package metrics) into a PNG for `qvd plot`: train
// loss and eval loss against the step on top, eval accuracy against the step below, both
// panels sharing the step axis.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// Contract:
//   - Render is a pure function of its records and options plus one file write. The PNG is
//     written to a temporary file in the destination directory and renamed into place, so an
//     image viewer refreshing the file never sees half an image.
//   - Records are cleaned before plotting: a step that appears more than once (a run resumed
//     from a checkpoint repeats the steps after it) keeps its last record, and non-finite
//     losses and accuracies (fp16 overflow, divergence) are left out rather than breaking the
//     axes. Input with nothing left to plot is ErrNoData.
//   - Bad options are errors naming the field; errors from writing name the file. Render does
//     not panic on any input: a panic inside the plotting library is turned into an error.
//   - Render is safe to call concurrently with different paths.
package plot
