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
	KindVal   = "val"   // one evaluation pass over the validation split (data.val_split)
	// KindEvent: something happened to the run besides a step (Event names it); written by
	// rank 0 as it happens.
	KindEvent = "event"
	// KindMembers: rank 0's view of the cluster's members (Members), from gossip; written
	// when the view changes and at most every few seconds otherwise, in multi-node runs only.
	KindMembers = "members"
)

// Events (Record.Event of a KindEvent record).
const (
	// EventRendezvous: the job's members formed a group (Gen, World); a run resumed with a
	// new rendezvous records another, with a larger Gen: the group re-formed.
	EventRendezvous = "rendezvous"
	// EventMemberLost: a member of the job left or failed; Detail names its rank.
	EventMemberLost = "member_lost"
	// EventStopped: the run ended before its last step, at Step: interrupted (a signal, with
	// a checkpoint) or failed (a lost rank, a full disk); Detail says which and why.
	EventStopped = "stopped"
	// EventMicroBatchHalved: memory trouble made every rank halve its micro-batch and double
	// accumulation after Step; Detail says why.
	EventMicroBatchHalved = "micro_batch_halved"
	// EventReform (elastic training): the group lost members and re-formed without them as
	// generation Gen of World ranks, from OldWorld; Detail is the cause, Source where the
	// state came from (SourceMemory or SourceCheckpoint), LostSteps how many completed steps
	// are trained again, ResumeSeconds the time from the loss (the survivor's step failing)
	// to the first step completed at the new world (the record is written then; without
	// such a step, when the run ends first, it is left out). Step is the step it continues
	// from.
	EventReform = "reform"
)

// Sources of the state an EventReform continued from.
const (
	SourceMemory     = "memory"     // the survivors' in-memory state (ZeRO stage 0: every rank holds it all)
	SourceCheckpoint = "checkpoint" // the newest complete checkpoint in checkpoint.dir
	// SourceSnapshot: ZeRO stages 1-2, the lost shards rebuilt from the copies their ring
	// neighbours kept (elastic.snapshot_every).
	SourceSnapshot = "snapshot"
)

// Member is one member of the cluster as rank 0 saw it through gossip (see package cluster).
type Member struct {
	Name  string `json:"name"`
	State string `json:"state"` // alive, suspect, dead or left (memberlist's verdict), or missing
	Role  string `json:"role,omitempty"`
	Job   string `json:"job,omitempty"`   // the job it trains in ("" before a roster)
	Rank  int    `json:"rank"`            // -1: none (an observer)
	Step  int64  `json:"step,omitempty"`  // the last step it gossiped
	Gen   uint64 `json:"gen,string"`      // its process generation: a restarted process has another
	Model uint64 `json:"model,omitempty"` // bytes it holds for training (the sum of its Memory categories)
	RSS   uint64 `json:"rss,omitempty"`   // its resident set size, bytes
	Peak  uint64 `json:"peak,omitempty"`  // its largest Go heap at a phase's end (its PhaseHeap's largest), bytes
}

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
	// "host_optimizer", ...; see memory.States), in bytes; zero categories are left out.
	Memory map[string]int64 `json:"memory,omitempty"`
	// PhaseHeap is the largest Go heap sampled at the end of each phase so far
	// ("forward+backward", "communication", "optimizer"), in bytes.
	PhaseHeap map[string]int64 `json:"phase_heap,omitempty"`
	// GPU is each GPU's memory from NVML ("gpu0_used", "gpu0_free", "gpu0_total"), in bytes,
	// on the steps where the monitor logged its line; absent without GPUs.
	GPU map[string]int64 `json:"gpu,omitempty"`

	Accuracy float64 `json:"accuracy,omitempty"` // eval only: fraction of test samples classified correctly
	Samples  int     `json:"samples,omitempty"`  // eval only: number of test samples evaluated

	// OOMSkipped (train only) is how many micro-batches, over all ranks, ran out of memory
	// and were skipped in this step; with Skipped, every one of them did.
	OOMSkipped int `json:"oom_skipped,omitempty"`

	Event  string `json:"event,omitempty"`      // event only: EventRendezvous, ...
	Detail string `json:"detail,omitempty"`     // event only: what happened, for people
	Gen    uint64 `json:"gen,string,omitempty"` // EventRendezvous: the rendezvous generation (a string in JSON: a nanosecond clock does not fit a JavaScript number)
	World  int    `json:"world,omitempty"`      // EventRendezvous, EventReform: the group's size

	Members []Member `json:"members,omitempty"` // members only

	// EventReform only: see EventReform.
	OldWorld      int     `json:"old_world,omitempty"`
	Source        string  `json:"source,omitempty"`
	LostSteps     int64   `json:"lost_steps,omitempty"`
	ResumeSeconds float64 `json:"resume_seconds,omitempty"`
}
