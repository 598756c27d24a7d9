package promexport

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/metrics"
)

// Options describe the rank an Exporter reports for.
type Options struct {
	Rank, World int
	// Generation is the job's rendezvous generation (cluster.Roster.Gen); 0 for a single
	// process.
	Generation uint64
	// Wire counts the collective's bytes on the wire by op; nil reports none (a single
	// process, or NCCL, whose traffic qvd does not see).
	Wire *collective.WireCounts
	// NoRuntime leaves out the Go runtime and process collectors (for tests that compare
	// the whole exposition).
	NoRuntime bool
}

// commPhase is the PhaseSeconds entry for the time the step's gradient collectives took
// (see metrics.Record.PhaseSeconds).
const commPhase = "reduction"

// Exporter keeps one rank's latest figures for Prometheus. It is a trainer.MetricsSink and a
// prometheus.Collector registered on its own Registry. Safe for concurrent use.
type Exporter struct {
	reg   *prometheus.Registry
	world int
	gen   uint64
	wire  *collective.WireCounts

	mu struct {
		sync.Mutex
		train, eval bool // a record of the kind has arrived
		step        int64
		epoch       float64
		time        float64
		loss        float64
		lr          float64
		samples     float64
		gradNorm    float64
		scale       float64
		skipped     uint64
		lastSkipped bool    // the last step was skipped: it has no gradient norm
		commSeconds float64 // the sum of every step's commPhase
		rss, heap   uint64
		liveHeap    uint64
		available   uint64
		phases      map[string]float64
		memory      map[string]int64
		gpu         map[string]int64
		evalStep    int64
		evalLoss    float64
		evalAcc     float64
	}
}

var _ prometheus.Collector = (*Exporter)(nil)

// New returns an Exporter whose registry holds it (and, unless o.NoRuntime, the Go and
// process collectors), every metric labelled rank="<o.Rank>".
func New(o Options) (*Exporter, error) {
	e := &Exporter{reg: prometheus.NewRegistry(), world: o.World, gen: o.Generation, wire: o.Wire}
	e.mu.phases = map[string]float64{}
	e.mu.memory = map[string]int64{}
	e.mu.gpu = map[string]int64{}
	r := prometheus.WrapRegistererWith(prometheus.Labels{"rank": strconv.Itoa(o.Rank)}, e.reg)
	cs := []prometheus.Collector{e}
	if !o.NoRuntime {
		cs = append(cs, collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	}
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			return nil, fmt.Errorf("promexport: registering a collector: %w", err)
		}
	}
	return e, nil
}

// Gatherer is the registry the Exporter serves, for tests and other handlers.
func (e *Exporter) Gatherer() prometheus.Gatherer { return e.reg }

// Write keeps the record's figures; it never fails. Train records replace the previous
// step's; eval records the last evaluation's.
func (e *Exporter) Write(r metrics.Record) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if r.Kind == metrics.KindEval {
		e.mu.eval = true
		e.mu.evalStep, e.mu.evalLoss, e.mu.evalAcc = r.Step, r.Loss, r.Accuracy
		return nil
	}
	if r.Kind != metrics.KindTrain {
		return nil
	}
	m := &e.mu
	m.train = true
	m.step, m.epoch, m.time, m.loss = r.Step, r.Epoch, r.Time, r.Loss
	m.lr, m.samples, m.gradNorm, m.scale = r.LR, r.SamplesPerSec, r.GradNorm, r.Scale
	m.lastSkipped = r.Skipped
	if r.Skipped {
		m.skipped++
	}
	if s := r.PhaseSeconds[commPhase]; s > 0 && !math.IsInf(s, 0) {
		m.commSeconds += s
	}
	m.rss, m.heap, m.liveHeap, m.available = r.RSSBytes, r.HeapBytes, r.LiveHeapBytes, r.AvailableBytes
	// The maps are refilled in place: the same keys come every step, so this allocates
	// only when a key is new.
	clear(m.phases)
	for k, v := range r.PhaseSeconds {
		m.phases[k] = v
	}
	clear(m.memory)
	for k, v := range r.Memory {
		m.memory[k] = v
	}
	if r.GPU != nil { // the monitor samples the GPUs on some steps only: keep the last sample
		clear(m.gpu)
		for k, v := range r.GPU {
			m.gpu[k] = v
		}
	}
	return nil
}

// The metrics. Gauges describe the last train (or eval) record; _total are counters since
// the process started.
var (
	descStep      = desc("qvd_step", "Global optimizer step last completed.")
	descEpoch     = desc("qvd_epoch", "Fractional epoch at the last step.")
	descStepTime  = desc("qvd_step_timestamp_seconds", "When the last step completed, in seconds since the Unix epoch.")
	descLoss      = desc("qvd_loss", "Training loss of the last step on this rank (mean over its micro-batches).")
	descLR        = desc("qvd_learning_rate", "Learning rate of the last step.")
	descSamples   = desc("qvd_samples_per_second", "Training throughput of the last step, samples per second (global batch / step time).")
	descGradNorm  = desc("qvd_grad_norm", "Global L2 norm of the unscaled gradient of the last step, before clipping (absent on a skipped step).")
	descScale     = desc("qvd_loss_scale", "Dynamic loss scale in use at the last step (fp16 only).")
	descSkipped   = desc("qvd_skipped_steps_total", "Optimizer steps skipped (fp16 overflow, or every micro-batch out of memory) since the process started.")
	descPhase     = desc("qvd_step_phase_seconds", "Where the last step's wall time went, by phase (reduction: the gradient collectives' time, overlapped or not).", "phase")
	descComm      = desc("qvd_communication_seconds", "Time the last step's gradient collectives (all-reduce or reduce-scatter) took.")
	descCommTotal = desc("qvd_communication_seconds_total", "Time the gradient collectives took, summed over the steps since the process started.")
	descMemory    = desc("qvd_memory_bytes", "What the rank holds for training, by category (qvd's accounting, see memory.States).", "category")
	descRSS       = desc("qvd_rss_bytes", "Resident set size of the process, sampled at the last step.")
	descHeap      = desc("qvd_heap_bytes", "Go heap in use, sampled at the last step.")
	descLiveHeap  = desc("qvd_live_heap_bytes", "Go heap the last garbage collection kept.")
	descAvailable = desc("qvd_available_memory_bytes", "Memory the system had available at the last step.")
	descGPU       = desc("qvd_gpu_memory_bytes", "GPU memory from NVML at the last sample, by GPU and state (used, free, total).", "gpu", "state")
	descEvalStep  = desc("qvd_eval_step", "Step of the last evaluation.")
	descEvalLoss  = desc("qvd_eval_loss", "Mean test loss of the last evaluation.")
	descEvalAcc   = desc("qvd_eval_accuracy", "Test accuracy (fraction correct) of the last evaluation.")
	descWorld     = desc("qvd_world_size", "Ranks in the job.")
	descGen       = desc("qvd_generation", "The job's rendezvous generation: the coordinator's clock (ns) when the roster formed, larger for a later rendezvous; 0 for a single process.")
	descSent      = desc("qvd_collective_sent_bytes_total", "Bytes this rank sent for collectives, frame headers included, by op.", "op")
	descRecv      = desc("qvd_collective_received_bytes_total", "Bytes this rank received for collectives, frame headers included, by op.", "op")
)

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(name, help, labels, nil)
}

// Describe sends every metric's description.
func (e *Exporter) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descStep, descEpoch, descStepTime, descLoss, descLR, descSamples, descGradNorm,
		descScale, descSkipped, descPhase, descComm, descCommTotal, descMemory, descRSS, descHeap, descLiveHeap,
		descAvailable, descGPU, descEvalStep, descEvalLoss, descEvalAcc, descWorld, descGen, descSent, descRecv} {
		ch <- d
	}
}

// Collect sends the current values. A figure the last record left out (no loss scale in
// fp32, no gradient norm on a skipped step) is left out rather than reported as 0.
func (e *Exporter) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	gauge(descWorld, float64(e.world))
	gauge(descGen, float64(e.gen))
	if e.wire != nil {
		for _, op := range collective.OpCodes() {
			counter(descSent, float64(e.wire.Sent(op)), collective.OpName(op))
			counter(descRecv, float64(e.wire.Received(op)), collective.OpName(op))
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	m := &e.mu
	counter(descSkipped, float64(m.skipped))
	counter(descCommTotal, m.commSeconds)
	if m.eval {
		gauge(descEvalStep, float64(m.evalStep))
		gauge(descEvalLoss, m.evalLoss)
		gauge(descEvalAcc, m.evalAcc)
	}
	if !m.train {
		return
	}
	gauge(descStep, float64(m.step))
	gauge(descEpoch, m.epoch)
	gauge(descStepTime, m.time)
	gauge(descLoss, m.loss)
	optional := func(d *prometheus.Desc, v float64) {
		if v != 0 {
			gauge(d, v)
		}
	}
	gauge(descLR, m.lr)
	optional(descSamples, m.samples)
	if !m.lastSkipped {
		gauge(descGradNorm, m.gradNorm)
	}
	optional(descScale, m.scale)
	optional(descRSS, float64(m.rss))
	optional(descHeap, float64(m.heap))
	optional(descLiveHeap, float64(m.liveHeap))
	optional(descAvailable, float64(m.available))
	if s, ok := m.phases[commPhase]; ok {
		gauge(descComm, s)
	}
	for k, v := range m.phases {
		gauge(descPhase, v, k)
	}
	for k, v := range m.memory {
		gauge(descMemory, float64(v), k)
	}
	for k, v := range m.gpu {
		// NVML keys are "gpu<i>_<state>" (see metrics.Record.GPU).
		gpu, state, ok := strings.Cut(strings.TrimPrefix(k, "gpu"), "_")
		if !ok {
			gpu, state = k, ""
		}
		gauge(descGPU, float64(v), gpu, state)
	}
}
