package memory

// States is what a rank holds for training (qvd's accounting), in bytes, by where it lives
// and what it is. zero.Engine measures it from the buffers it actually allocated and
// zero.Estimate predicts it; the monitor compares it with what the process really uses.
type States struct {
	Device StateBytes `json:"device"`
	Host   StateBytes `json:"host"` // with offload: what the optimizer step uses in host memory
}

// StateBytes is one side's accounting.
type StateBytes struct {
	Params    int64 `json:"params"`    // working-precision parameters (full)
	Grads     int64 `json:"grads"`     // gradients held across micro-batches (full at stages 0-1, the shard at 2)
	Master    int64 `json:"master"`    // fp32 master weights held apart from the parameters
	Optimizer int64 `json:"optimizer"` // optimizer state (moments, momentum)
	Buffers   int64 `json:"buffers"`   // communication and transfer staging buffers
}

// Total sums the categories.
func (b StateBytes) Total() int64 { return b.Params + b.Grads + b.Master + b.Optimizer + b.Buffers }

// Total sums both sides.
func (s States) Total() int64 { return s.Device.Total() + s.Host.Total() }

// Record flattens the accounting into the metrics file's keys ("device_params",
// "host_optimizer", ...), leaving out categories that are zero.
func (s States) Record() map[string]int64 {
	out := make(map[string]int64, 11)
	for _, side := range []struct {
		name string
		b    StateBytes
	}{{"device", s.Device}, {"host", s.Host}} {
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
