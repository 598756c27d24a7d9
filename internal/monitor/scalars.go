package monitor

import (
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/tbevents"
)

// Tags of the scalars, grouped by prefix into TensorBoard's sections.
const (
	TagTrainLoss     = "train/loss"
	TagLR            = "train/lr"
	TagSamplesPerSec = "train/samples_per_sec"
	TagGradNorm      = "train/grad_norm"
	TagLossScale     = "train/loss_scale"
	TagEvalLoss      = "eval/loss"
	TagEvalAccuracy  = "eval/accuracy"
	TagValLoss       = "val/loss"
	TagValAccuracy   = "val/accuracy"
	TagRSS           = "memory/rss_bytes"
	TagHeap          = "memory/heap_bytes"
	// TagModelStates is what the rank holds for training (parameters, gradients, optimizer
	// state; metrics.Record.Memory summed), the figure `qvd status` shows.
	TagModelStates = "memory/model_states_bytes"
)

// Scalars appends r's scalars to dst and returns it. A train record gives the loss and the
// learning rate always (a zero learning rate in warm-up is a value), and the throughput,
// gradient norm, loss scale and memory figures the record has; an eval record gives its loss
// and accuracy. Other kinds give nothing.
func Scalars(dst []tbevents.Scalar, r *metrics.Record) []tbevents.Scalar {
	add := func(tag string, v float64) { dst = append(dst, tbevents.Scalar{Tag: tag, Value: v}) }
	switch r.Kind {
	case metrics.KindTrain:
		add(TagTrainLoss, r.Loss)
		add(TagLR, r.LR)
		if r.SamplesPerSec > 0 {
			add(TagSamplesPerSec, r.SamplesPerSec)
		}
		if r.GradNorm != 0 {
			add(TagGradNorm, r.GradNorm)
		}
		if r.Scale > 0 {
			add(TagLossScale, r.Scale)
		}
		if r.RSSBytes > 0 {
			add(TagRSS, float64(r.RSSBytes))
		}
		if r.HeapBytes > 0 {
			add(TagHeap, float64(r.HeapBytes))
		}
		if len(r.Memory) > 0 {
			var total int64
			for _, b := range r.Memory {
				total += b
			}
			add(TagModelStates, float64(total))
		}
	case metrics.KindEval:
		add(TagEvalLoss, r.Loss)
		add(TagEvalAccuracy, r.Accuracy)
	case metrics.KindVal:
		add(TagValLoss, r.Loss)
		add(TagValAccuracy, r.Accuracy)
	}
	return dst
}
