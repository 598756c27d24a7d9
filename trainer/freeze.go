package trainer

import (
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// Frozen tensors (model.Layout.Frozen) are a prefix of the flat parameters that the ZeRO
// engine never sees; these keep its values, in fp32 for checkpoints.

// setFrozen sets the frozen prefix of the parameters from fp32 values (rounded to the working
// precision), keeping the fp32 copy for checkpoints in fp16/bf16.
func (t *Trainer) setFrozen(w []float32) {
	if len(w) == 0 {
		return
	}
	copy(t.w.params[:len(w)], w)
	if t.spec.format != half.FP32 {
		t.w.frozenMaster = append(t.w.frozenMaster[:0], w...)
		vec.Round(t.w.params[:len(w)], t.spec.format)
	}
}

// frozenWeights is the fp32 frozen prefix. Buffers in it (batch norm's running statistics)
// are updated by the forward pass in the working weights, so they are taken from there.
func (t *Trainer) frozenWeights() []float32 {
	if t.w.frozenMaster != nil {
		for _, tt := range t.layout.Tensors {
			if tt.Buffer {
				copy(t.w.frozenMaster[tt.Offset:tt.Offset+tt.Size], t.w.params[tt.Offset:tt.Offset+tt.Size])
			}
		}
		return t.w.frozenMaster
	}
	return t.w.params[:t.layout.Frozen]
}
