package job

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"

	"go.uber.org/zap"

	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/rundir"
)

// takeOverRunDir is called by a process that became rank 0 of a re-formed group without
// holding the run directory: the process that held it (the first rank 0) is gone. It takes
// the directory's lock — which the kernel released when that process died, and which stays
// refused while it lives, so two processes never append to one metrics.jsonl — and reopens
// metrics.jsonl for appending (Create drops a line the dead writer left half-written). It
// returns nil, logging why, when the directory is not on this host (its metrics.jsonl has
// no rendezvous record of this job), is still held, or cannot be opened: training goes on
// without further records, as before. release drops the lock.
func (j *job) takeOverRunDir() (mw *metrics.Writer, release func()) {
	dir := j.cfg.Run.Out
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		j.log.Warn("rank 0 of the re-formed group cannot see the run directory: no further metrics are written", zap.String("out", dir), zap.Error(err))
		return nil, nil
	}
	if !jobMetrics(j.cfg.MetricsPath(), "job "+j.roster.Job) {
		// A directory of that name on this host is not the job's (run.out is relative, or
		// another run's): never append to it.
		j.log.Warn("rank 0 of the re-formed group finds no metrics of this job in the run directory: no further metrics are written", zap.String("out", dir))
		return nil, nil
	}
	lock, stale, err := rundir.Acquire(dir)
	if err != nil {
		j.log.Warn("rank 0 of the re-formed group cannot take over the run directory: no further metrics are written", zap.String("out", dir), zap.Error(err))
		return nil, nil
	}
	mw, err = metrics.Create(j.cfg.MetricsPath(), true)
	if err != nil {
		_ = lock.Release()
		j.log.Warn("rank 0 of the re-formed group cannot reopen the metrics: no further metrics are written", zap.Error(err))
		return nil, nil
	}
	fields := []zap.Field{zap.String("metrics", mw.Path())}
	if stale != nil {
		fields = append(fields, zap.Int("previous_pid", stale.PID))
	}
	j.log.Warn("took over the run directory from the lost rank 0", fields...)
	return mw, func() { _ = lock.Release() }
}

// jobMetrics reports whether the metrics file at path holds a rendezvous record with detail
// (the job's id): whether it is this job's. Lines that do not parse (a torn last line) are
// skipped.
func jobMetrics(path, detail string) bool {
	f, err := os.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.Contains(line, []byte(metrics.EventRendezvous)) {
			continue
		}
		var r struct {
			Event  string `json:"event"`
			Detail string `json:"detail"`
		}
		if json.Unmarshal(line, &r) == nil && r.Event == metrics.EventRendezvous && r.Detail == detail {
			return true
		}
	}
	return false
}
