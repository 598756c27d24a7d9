// Package progress prints the trainer's live progress: step, epoch, loss, throughput,
// learning rate, ETA and (for fp16) the loss scale.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// A Line has two modes, chosen by the caller (typically Config.TTY = IsTerminal(os.Stdout)):
//   - TTY: one line redrawn in place with "\r" and ESC[K, at most every minRedraw (~10 times a
//     second), cut to the terminal width so it never wraps. Log lines written through
//     LogWriter clear the progress line, appear, and have the progress line redrawn below
//     them, so the two never mix on screen.
//   - Plain (a log file, CI, `qvd launch` relaying a worker's output): a whole line per
//     Config.Interval, always for the first update and at Done, and never a carriage return
//     or escape code, so the output greps and diffs cleanly.
//
// Update never blocks on a timer and starts no goroutine: throttling compares the injected
// clock with the time of the last output, which keeps tests deterministic. The cost is that
// an update suppressed by the throttle stays unseen until the next Update, LogWriter write or
// Done; at the trainer's step rate that is a fraction of a second.
//
// All methods of Line, and the writers returned by LogWriter, are safe for concurrent use.
// Update after Done is ignored. If writing the progress line fails (a closed terminal), the
// Line stops drawing and Err reports the first error; training goes on.
package progress
