package main

import (
	"runtime/debug"

	"go.uber.org/zap"

	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
	"github.com/qvd/qvd/zero"
)

// applyMemoryLimit checks memory.limit against this rank's model states (what the trainer
// has just allocated, by the engine's own accounting) and sets it as the Go runtime's soft
// limit. restore puts back the previous limit (tests run `qvd train` in-process).
func applyMemoryLimit(limit memory.Bytes, states zero.Memory, log *zap.Logger) (restore func(), err error) {
	if limit <= 0 {
		return func() {}, nil
	}
	r := memstat.NewReader()
	inUse := r.Read().GoTotal
	r.Close()
	if err := memory.CheckLimit(limit, states, inUse); err != nil {
		return nil, err
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
