package trainer

import (
	"maps"
	"slices"

	"go.uber.org/zap"
)

// memoryRecord flattens the engine's accounting for the metrics file, with the collective's
// own frame buffers (which grow with use, up to a bound set by collective.chunk_bytes) as
// device_comm_buffers.
func (t *Trainer) memoryRecord() map[string]int64 {
	out := t.eng.Memory().Record()
	if f := int64(t.layout.Frozen); f > 0 {
		// Frozen parameters are held (the model computes with them) but nothing else is.
		out["device_frozen_params"] = 4 * f
		if t.w.frozenMaster != nil {
			out["host_frozen_master"] = 4 * int64(len(t.w.frozenMaster))
		}
	}
	if c, ok := t.group.comm.(interface{ BufferBytes() int64 }); ok {
		if b := c.BufferBytes(); b > 0 {
			out["device_comm_buffers"] = b
		}
	}
	return out
}

// logMemory logs what this rank holds, so the savings of a ZeRO stage are visible at start.
func (t *Trainer) logMemory() {
	m := t.eng.Memory()
	fields := []zap.Field{zap.Int("zero_stage", t.spec.zero.Stage), zap.Int64("total_bytes", m.Total())}
	rec := t.memoryRecord()
	for _, k := range slices.Sorted(maps.Keys(rec)) {
		fields = append(fields, zap.Int64(k, rec[k]))
	}
	if f := t.layout.Frozen; f > 0 {
		trainable := 0
		for _, ts := range t.layout.Tensors {
			if !ts.Frozen {
				trainable += ts.Size
			}
		}
		fields = append(fields, zap.Int("trainable_params", trainable), zap.Int("total_params", t.layout.NumParams()))
	}
	t.log.Info("model state memory", fields...)
}
