// Package metrics defines the per-step metrics record that the trainer writes as JSON lines
// (one object per line) and that `qvd plot` and users' own scripts read back.
//
// The file is append-only and line-oriented so a run that is killed leaves every completed
// line readable, and so `jq`/pandas (`pd.read_json(path, lines=True)`) can load it directly.
package metrics

// Kinds of records.
const (
	KindTrain = "train" // one optimizer step
	KindEval  = "eval"  // one evaluation pass over the test set
)

// Record is one line of the metrics file. Train records fill the step fields; eval records
// fill Accuracy and Loss (mean test loss). Zero-valued optional fields are omitted.
type Record struct {
	Kind  string  `json:"kind"`
	Time  float64 `json:"time"`  // seconds since the Unix epoch
	Step  int64   `json:"step"`  // global optimizer step (1-based: the step just completed)
	Epoch float64 `json:"epoch"` // fractional epoch: completed epochs + position in the current one
	Loss  float64 `json:"loss"`  // train: mean micro-batch loss of the step; eval: mean test loss

	LR            float64 `json:"lr,omitempty"`
	Scale         float64 `json:"scale,omitempty"`     // loss scale in use for the step (fp16 only)
	GradNorm      float64 `json:"grad_norm,omitempty"` // global L2 norm of the unscaled gradient, before clipping
	SamplesPerSec float64 `json:"samples_per_sec,omitempty"`
	Skipped       bool    `json:"skipped,omitempty"` // optimizer step skipped (fp16 overflow)

	HeapBytes uint64 `json:"heap_bytes,omitempty"` // Go heap in use
	RSSBytes  uint64 `json:"rss_bytes,omitempty"`  // resident set size of the process
	// The memory monitor's host figures (see package memory): the system's available memory,
	// the largest Go heap sample so far, the heap the last collection kept (no garbage), and
	// pages swapped in and out per second since the previous step.
	AvailableBytes uint64  `json:"available_bytes,omitempty"`
	MaxHeapBytes   uint64  `json:"max_heap_bytes,omitempty"`
	LiveHeapBytes  uint64  `json:"live_heap_bytes,omitempty"`
	SwapInRate     float64 `json:"swap_in_rate,omitempty"`
	SwapOutRate    float64 `json:"swap_out_rate,omitempty"`
	// PhaseSeconds is where the step's wall time went: "forward_backward" (the micro-batches'
	// passes; with overlap_comm the gradient's reductions run beside them), "gradient_wait"
	// (waiting for the reductions after the passes, and the loss and norm all-reduces),
	// "optimizer", and "reduction" (the time the gradient's collectives took, overlapped or not).
	PhaseSeconds map[string]float64 `json:"phase_seconds,omitempty"`
	// Memory is what the rank holds for training by category ("device_params",
	// "host_optimizer", ...; see zero.Memory), in bytes; zero categories are left out.
	Memory map[string]int64 `json:"memory,omitempty"`
	// PhaseHeap is the largest Go heap sampled at the end of each phase so far
	// ("forward+backward", "communication", "optimizer"), in bytes.
	PhaseHeap map[string]int64 `json:"phase_heap,omitempty"`
	// GPU is each GPU's memory from NVML ("gpu0_used", "gpu0_free", "gpu0_total"), in bytes,
	// on the steps where the monitor logged its line; absent without GPUs.
	GPU map[string]int64 `json:"gpu,omitempty"`

	Accuracy float64 `json:"accuracy,omitempty"` // eval only: fraction of test samples classified correctly
	Samples  int     `json:"samples,omitempty"`  // eval only: number of test samples evaluated
}
