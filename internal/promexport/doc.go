// Package promexport serves a rank's training metrics in the Prometheus text format on
// /metrics, from its own prometheus.Registry (never the global default), with the Go runtime
// and process collectors beside qvd's own.
// It sits in the training layer of docs/architecture.md: it must not import configs, job or
// cmd.
//
// What it owns: the Exporter, a trainer.MetricsSink that keeps the last train and eval
// records' figures (step, loss, learning rate, samples/s, gradient norm, loss scale, skipped
// steps, the step's phases including the gradient reductions' time, memory by category, RSS,
// GPU memory), reads the collective's wire byte counters (collective.WireCounts) at scrape
// time, and reports the job's world size and rendezvous generation. Every metric carries a
// constant rank label; qvd's own are prefixed qvd_.
//
// Who calls it: package job builds one Exporter per process when monitoring.metrics_addr is set,
// passes it to the trainer beside the metrics file, and calls Listen then Close. Write is
// called from the trainer's step loop and Collect from the HTTP handler's goroutines: both
// are safe concurrently. Write copies the record's figures into storage reused from step to
// step, so a steady run allocates nothing per step here.
//
// Addresses: RankAddr turns the job's metrics_addr into a rank's own, so that the ranks of
// one machine (qvd launch) do not collide: rank r listens on port+r, and port 0 lets every
// rank pick a free port (Listen returns it; package job logs it).
package promexport
