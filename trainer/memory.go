package trainer

import (
	"maps"
	"slices"

	"go.uber.org/zap"

	"github.com/qvd/qvd/zero"
)

// memoryRecord flattens the engine's accounting for the metrics file.
func memoryRecord(m zero.Memory) map[string]int64 {
	out := make(map[string]int64, 10)
	for _, side := range []struct {
		name string
		b    zero.Bytes
	}{{"device", m.Device}, {"host", m.Host}} {
		for _, c := range []struct {
			name string
			v    int64
		}{{"params", side.b.Params}, {"grads", side.b.Grads}, {"master", side.b.Master}, {"optimizer", side.b.Optimizer}, {"buffers", side.b.Buffers}} {
			if c.v != 0 {
				out[side.name+"_"+c.name] = c.v
			}
		}
	}
	return out
}

// logMemory logs what this rank holds, so the savings of a ZeRO stage are visible at start.
func (t *Trainer) logMemory() {
	m := t.eng.Memory()
	fields := []zap.Field{zap.Int("zero_stage", t.zeroCfg.Stage), zap.Int64("total_bytes", m.Total())}
	rec := memoryRecord(m)
	for _, k := range slices.Sorted(maps.Keys(rec)) {
		fields = append(fields, zap.Int64(k, rec[k]))
	}
	t.log.Info("model state memory", fields...)
}
