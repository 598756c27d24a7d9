// Package dashboard serves a live web page for one run or one cluster: loss and test-accuracy
// curves, throughput, memory by category with the phase peaks, memory per rank, the cluster's
// members with rank, step, generation and health, and recent events (the group forming and
// re-forming, lost members, skipped and OOM-skipped steps, micro-batch halvings). It reads the
// run's metrics.jsonl (see package metrics) while the run writes it, and the members from a
// MemberSource when it has one.
// It sits in the training layer of docs/architecture.md: it must not import configs, job or
// cmd.
//
// What it owns: a Tail that reads the metrics file incrementally (each poll reads only the
// bytes appended since the last one, and never a line that is still being written); a
// ClusterView, the MemberSource over a cluster.Node (live members from gossip, departed ones
// with memberlist's verdict when it reads the node's events); MembersLog, which decides when
// rank 0 writes its view of the members to the metrics file; and a Handler that serves the
// embedded page on /, the records as JSON on /api/metrics?since=N and the live members on
// /api/members. The page polls both endpoints once a second and draws the curves itself on
// <canvas>: it loads nothing from the network, so it works on an air-gapped cluster.
//
// Who calls it: `qvd dashboard RUN_DIR|PEER` (cmd/qvd) builds a Handler — with a ClusterView
// over an observer node for PEER — and calls Listen, then Close; `qvd train --dashboard-addr`
// does the same on rank 0 with a view of its own node, and rank 0 of a multi-node job writes
// MembersLog's records with its metrics. Handler, Tail and ClusterView are safe for
// concurrent use: requests from several browser tabs share one Tail under its mutex.
//
// Where each figure comes from: rank 0's train records give the curves, memory by category
// and phase peaks (phase_heap); each member gossips its step, model-state bytes, RSS and
// largest phase-end heap (cluster.Meta), which give the members table and memory per rank,
// live from a ClusterView or as recorded in the file's members records (then as of rank 0's
// last one). Without either (a single-process run) memory per rank shows rank 0 alone.
//
// Contract of /api/metrics: the response is {"records": [...], "next": M, "more": bool,
// "gen": G, "reset": bool, "malformed": K}. records are the file's records with index >=
// since, in file order, at most a few thousand (more is set when there are others ready); the
// client passes next as since, and gen as gen, on its next poll. A missing file is an empty list, not an
// error (the run may not have written its first step yet). When the file shrinks (replaced
// by a new run), the Tail starts over and a poll whose since lies beyond what it holds gets
// every record with reset set, so the page clears its curves. A complete line that does not
// parse is skipped and counted in malformed rather than stopping the dashboard. A Handler
// without a metrics file (PEER alone) answers no records with no_file set.
//
// Contract of /api/members: {"live": bool, "source": S, "time": T, "members": [...]}; live is
// false without a MemberSource, and the page then shows the file's last members record.
package dashboard
