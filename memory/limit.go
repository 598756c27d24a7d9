package memory

import (
	"errors"
	"fmt"
	"math"

	"github.com/qvd/qvd/internal/memstat"
)

// Headroom is the share of memory.limit kept for what the model states do not include —
// activations, the evaluation graph, collective buffers, the runtime: the memory guides' 20%,
// as `qvd estimate --recommend` keeps.
const Headroom = 0.20

// ErrLimitTooLow is returned by CheckLimit when memory.limit cannot hold the model states.
var ErrLimitTooLow = errors.New("memory.limit is too low")

// CheckLimit checks that limit (0: none) leaves room, after Headroom, for states (this rank's
// model states) and for inUse (what the Go runtime already maps: datasets, the model graph,
// the states themselves; 0 if unknown). The error names memory.limit, the need and its parts.
func CheckLimit(limit Bytes, states States, inUse uint64) error {
	if limit <= 0 {
		return nil
	}
	need := states.Total()
	usable := int64(float64(limit) * (1 - Headroom))
	if usable >= need {
		if int64(inUse) > usable {
			return fmt.Errorf("%w: memory.limit %s (%d bytes) leaves %s after %.0f%% headroom, but the process already holds %s "+
				"(datasets, model graph and model states); set memory.limit to at least %s",
				ErrLimitTooLow, limit, int64(limit), fb(usable), Headroom*100, fb(int64(inUse)), atLeast(int64(inUse)))
		}
		return nil
	}
	all := StateBytes{}
	for _, b := range []StateBytes{states.Device, states.Host} {
		all.Params += b.Params
		all.Grads += b.Grads
		all.Master += b.Master
		all.Optimizer += b.Optimizer
		all.Buffers += b.Buffers
	}
	return fmt.Errorf("%w: memory.limit %s (%d bytes) leaves %s after %.0f%% headroom for activations and the runtime, "+
		"but this rank's model states need %s (parameters %s, gradients %s, master weights %s, optimizer state %s, buffers %s); "+
		"set memory.limit to at least %s, or need less: a higher zero_optimization.stage, more ranks",
		ErrLimitTooLow, limit, int64(limit), fb(usable), Headroom*100, fb(need),
		fb(all.Params), fb(all.Grads), fb(all.Master), fb(all.Optimizer), fb(all.Buffers),
		atLeast(need))
}

func fb(v int64) string { return memstat.FormatBytes(uint64(max(v, 0))) }

// roundUp rounds b up to a whole MiB (KiB below one MiB), so the suggestion reads as a size
// one would type.
func (b Bytes) roundUp() Bytes {
	unit := Bytes(1 << 20)
	if b < unit {
		unit = 1 << 10
	}
	return (b + unit - 1) / unit * unit
}

// atLeast is the smallest limit, in a round size, that leaves need after Headroom.
func atLeast(need int64) Bytes { return Bytes(math.Round(float64(need) / (1 - Headroom))).roundUp() }
