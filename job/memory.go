package job

import (
	"runtime/debug"

	"go.uber.org/zap"

	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
)

// applyMemoryLimit checks memory.limit against this rank's model states (what the trainer
// has just allocated, by the engine's own accounting) and sets it as the Go runtime's soft
// limit. restore puts back the previous limit (tests run `qvd train` in-process).
func applyMemoryLimit(limit memory.Bytes, states memory.States, log *zap.Logger) (restore func(), err error) {
	if limit <= 0 {
		return func() {}, nil
	}
	r := memstat.NewReader()
	snap := r.Read()
	r.Close()
	if err := memory.CheckLimit(limit, states, snap.GoTotal); err != nil {
		return nil, err
	}
	if snap.CgroupLimit > 0 && uint64(limit) > snap.CgroupLimit {
		// The soft limit would never be reached: the kernel OOM-kills the process first.
		log.Warn("memory.limit is above this process's memory cgroup limit, which the kernel enforces first",
			zap.String("limit", limit.String()), zap.Uint64("cgroup_limit_bytes", snap.CgroupLimit), zap.String("cgroup", snap.CgroupDir))
	}
	prev := debug.SetMemoryLimit(int64(limit))
	log.Info("memory limit set", zap.String("limit", limit.String()), zap.Int64("limit_bytes", int64(limit)),
		zap.Int64("model_state_bytes", states.Total()))
	return func() { debug.SetMemoryLimit(prev) }, nil
}

// logMeasure logs a scoped measure's result.
func logMeasure(log *zap.Logger, d memory.Delta) {
	log.Info("memory change: "+d.String(), zap.String("what", d.Name), zap.Int64("heap_delta_bytes", d.Heap),
		zap.Int64("rss_delta_bytes", d.RSS), zap.Uint64("allocated_bytes", d.Allocated))
}
