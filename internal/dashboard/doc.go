// Package dashboard serves a live web page for one run: its loss and test-accuracy curves,
// throughput, memory by category and RSS, and recent events (skipped steps, evaluations),
// read from the run's metrics.jsonl (see package metrics) while the run writes it.
//
// What it owns: a Tail that reads the metrics file incrementally (each poll reads only the
// bytes appended since the last one, and never a line that is still being written), and a
// Handler that serves the embedded page on / and the records as JSON on
// /api/metrics?since=N. The page polls that endpoint once a second and draws the curves
// itself on <canvas>: it loads nothing from the network, so it works on an air-gapped cluster.
//
// Who calls it: `qvd dashboard RUN_DIR` (cmd/qvd) builds a Handler and calls Listen, then
// Close. Handler and Tail are safe for concurrent use: requests from several browser tabs
// share one Tail under its mutex.
//
// Contract of /api/metrics: the response is {"records": [...], "next": M, "more": bool,
// "gen": G, "reset": bool, "malformed": K}. records are the file's records with index >=
// since, in file order, at most a few thousand (more is set when there are others ready); the
// client passes next as since, and gen as gen, on its next poll. A missing file is an empty list, not an
// error (the run may not have written its first step yet). When the file shrinks (replaced
// by a new run), the Tail starts over and a poll whose since lies beyond what it holds gets
// every record with reset set, so the page clears its curves. A complete line that does not
// parse is skipped and counted in malformed rather than stopping the dashboard.
package dashboard
