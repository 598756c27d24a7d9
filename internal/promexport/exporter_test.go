package promexport

import (
	"context"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/metrics"
)

// TestExporterExposition feeds records in and compares the whole exposition with the text
// Prometheus would scrape: names, types, labels (rank on every one) and values; figures a
// record leaves out stay out.
func TestExporterExposition(t *testing.T) {
	wire := &collective.WireCounts{}
	e, err := New(Options{Rank: 1, World: 2, Generation: 3, Wire: wire, NoRuntime: true})
	if err != nil {
		t.Fatal(err)
	}
	// Before any record: the job's figures and zero counters only.
	if err := testutil.GatherAndCompare(e.Gatherer(), strings.NewReader(`
# HELP qvd_world_size Ranks in the job.
# TYPE qvd_world_size gauge
qvd_world_size{rank="1"} 2
# HELP qvd_generation The job's rendezvous generation: the coordinator's clock (ns) when the roster formed, larger for a later rendezvous; 0 for a single process.
# TYPE qvd_generation gauge
qvd_generation{rank="1"} 3
# HELP qvd_skipped_steps_total Optimizer steps skipped (fp16 overflow, or every micro-batch out of memory) since the process started.
# TYPE qvd_skipped_steps_total counter
qvd_skipped_steps_total{rank="1"} 0
`), "qvd_world_size", "qvd_generation", "qvd_skipped_steps_total", "qvd_loss", "qvd_step"); err != nil {
		t.Fatal(err)
	}

	write := func(r metrics.Record) {
		t.Helper()
		if err := e.Write(r); err != nil {
			t.Fatal(err)
		}
	}
	write(metrics.Record{Kind: metrics.KindTrain, Time: 1700000000, Step: 7, Epoch: 0.5, Loss: 0.75, LR: 0.001, Scale: 65536,
		SamplesPerSec: 1234, Skipped: true, RSSBytes: 1 << 30, HeapBytes: 1 << 20,
		PhaseSeconds: map[string]float64{"forward_backward": 0.5, "gradient_wait": 0.25, "reduction": 0.125, "optimizer": 0.0625},
		Memory:       map[string]int64{"device_params": 4096, "device_grads": 2048},
		GPU:          map[string]int64{"gpu0_used": 100, "gpu0_total": 1000}})
	write(metrics.Record{Kind: metrics.KindTrain, Time: 1700000001, Step: 8, Epoch: 0.75, Loss: 0.5, LR: 0.002, Scale: 32768,
		SamplesPerSec: 2000, GradNorm: 1.5, RSSBytes: 2 << 30, HeapBytes: 2 << 20, LiveHeapBytes: 1 << 19, AvailableBytes: 8 << 30,
		PhaseSeconds: map[string]float64{"forward_backward": 0.5, "gradient_wait": 0.25, "reduction": 0.375, "optimizer": 0.0625},
		Memory:       map[string]int64{"device_params": 4096}}) // no GPU sample this step: the last one stays
	write(metrics.Record{Kind: metrics.KindEval, Step: 8, Loss: 0.625, Accuracy: 0.875, Samples: 200})

	const want = `
# HELP qvd_step Global optimizer step last completed.
# TYPE qvd_step gauge
qvd_step{rank="1"} 8
# HELP qvd_epoch Fractional epoch at the last step.
# TYPE qvd_epoch gauge
qvd_epoch{rank="1"} 0.75
# HELP qvd_step_timestamp_seconds When the last step completed, in seconds since the Unix epoch.
# TYPE qvd_step_timestamp_seconds gauge
qvd_step_timestamp_seconds{rank="1"} 1.700000001e+09
# HELP qvd_loss Training loss of the last step on this rank (mean over its micro-batches).
# TYPE qvd_loss gauge
qvd_loss{rank="1"} 0.5
# HELP qvd_learning_rate Learning rate of the last step.
# TYPE qvd_learning_rate gauge
qvd_learning_rate{rank="1"} 0.002
# HELP qvd_samples_per_second Training throughput of the last step, samples per second (global batch / step time).
# TYPE qvd_samples_per_second gauge
qvd_samples_per_second{rank="1"} 2000
# HELP qvd_grad_norm Global L2 norm of the unscaled gradient of the last step, before clipping (absent on a skipped step).
# TYPE qvd_grad_norm gauge
qvd_grad_norm{rank="1"} 1.5
# HELP qvd_loss_scale Dynamic loss scale in use at the last step (fp16 only).
# TYPE qvd_loss_scale gauge
qvd_loss_scale{rank="1"} 32768
# HELP qvd_skipped_steps_total Optimizer steps skipped (fp16 overflow, or every micro-batch out of memory) since the process started.
# TYPE qvd_skipped_steps_total counter
qvd_skipped_steps_total{rank="1"} 1
# HELP qvd_step_phase_seconds Where the last step's wall time went, by phase (reduction: the gradient collectives' time, overlapped or not).
# TYPE qvd_step_phase_seconds gauge
qvd_step_phase_seconds{phase="forward_backward",rank="1"} 0.5
qvd_step_phase_seconds{phase="gradient_wait",rank="1"} 0.25
qvd_step_phase_seconds{phase="optimizer",rank="1"} 0.0625
qvd_step_phase_seconds{phase="reduction",rank="1"} 0.375
# HELP qvd_communication_seconds Time the last step's gradient collectives (all-reduce or reduce-scatter) took.
# TYPE qvd_communication_seconds gauge
qvd_communication_seconds{rank="1"} 0.375
# HELP qvd_communication_seconds_total Time the gradient collectives took, summed over the steps since the process started.
# TYPE qvd_communication_seconds_total counter
qvd_communication_seconds_total{rank="1"} 0.5
# HELP qvd_memory_bytes What the rank holds for training, by category (qvd's accounting, see memory.States).
# TYPE qvd_memory_bytes gauge
qvd_memory_bytes{category="device_params",rank="1"} 4096
# HELP qvd_rss_bytes Resident set size of the process, sampled at the last step.
# TYPE qvd_rss_bytes gauge
qvd_rss_bytes{rank="1"} 2.147483648e+09
# HELP qvd_heap_bytes Go heap in use, sampled at the last step.
# TYPE qvd_heap_bytes gauge
qvd_heap_bytes{rank="1"} 2.097152e+06
# HELP qvd_live_heap_bytes Go heap the last garbage collection kept.
# TYPE qvd_live_heap_bytes gauge
qvd_live_heap_bytes{rank="1"} 524288
# HELP qvd_available_memory_bytes Memory the system had available at the last step.
# TYPE qvd_available_memory_bytes gauge
qvd_available_memory_bytes{rank="1"} 8.589934592e+09
# HELP qvd_gpu_memory_bytes GPU memory from NVML at the last sample, by GPU and state (used, free, total).
# TYPE qvd_gpu_memory_bytes gauge
qvd_gpu_memory_bytes{gpu="0",rank="1",state="total"} 1000
qvd_gpu_memory_bytes{gpu="0",rank="1",state="used"} 100
# HELP qvd_eval_step Step of the last evaluation.
# TYPE qvd_eval_step gauge
qvd_eval_step{rank="1"} 8
# HELP qvd_eval_loss Mean test loss of the last evaluation.
# TYPE qvd_eval_loss gauge
qvd_eval_loss{rank="1"} 0.625
# HELP qvd_eval_accuracy Test accuracy (fraction correct) of the last evaluation.
# TYPE qvd_eval_accuracy gauge
qvd_eval_accuracy{rank="1"} 0.875
# HELP qvd_world_size Ranks in the job.
# TYPE qvd_world_size gauge
qvd_world_size{rank="1"} 2
# HELP qvd_generation The job's rendezvous generation: the coordinator's clock (ns) when the roster formed, larger for a later rendezvous; 0 for a single process.
# TYPE qvd_generation gauge
qvd_generation{rank="1"} 3
`
	if err := testutil.GatherAndCompare(e.Gatherer(), strings.NewReader(want), exposed(want)...); err != nil {
		t.Fatal(err)
	}
	if n, err := testutil.GatherAndCount(e.Gatherer()); err != nil || n != 27+10 {
		t.Fatalf("%d series (err %v), want the 27 above and 10 wire counters", n, err)
	}
}

// exposed lists the metric names in an exposition text.
func exposed(text string) []string {
	var names []string
	for _, l := range strings.Split(text, "\n") {
		if f := strings.Fields(l); len(f) >= 3 && f[0] == "#" && f[1] == "TYPE" {
			names = append(names, f[2])
		}
	}
	return names
}

// TestExporterWireBytes runs an all-reduce between two ranks over counting transports and
// checks the exported byte counters against the frames each transport carried: rank 0's
// sent bytes are rank 1's received bytes, and the payload is the ring's 2(N-1)/N of the
// buffer plus a header per frame.
func TestExporterWireBytes(t *testing.T) {
	_, ts := collective.NewInproc(2, 1)
	var counts [2]*collective.WireCounts
	var rings [2]*collective.Ring
	for r, tr := range ts {
		c := collective.Count(tr)
		if _, ok := c.(collective.DirectReceiver); ok != isDirect(tr) {
			t.Fatalf("rank %d: the counting transport changed whether the transport is a DirectReceiver", r)
		}
		counts[r] = c.WireCounts()
		ring, err := collective.NewRing(c, collective.Config{Transport: "inproc", Timeout: 10e9, ChunkBytes: 4 << 10})
		if err != nil {
			t.Fatal(err)
		}
		rings[r] = ring
		defer ring.Close()
		defer c.Close()
	}
	const n = 4096 // floats: 16 KiB, 4 pieces per half on each hop
	errs := make(chan error, 2)
	for r := range rings {
		go func() {
			buf := make([]float32, n)
			for i := range buf {
				buf[i] = float32(r)
			}
			errs <- rings[r].AllReduce(context.Background(), buf, collective.Sum, collective.Call{Wire: half.FP32})
		}()
	}
	for range rings {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for r := range counts {
		sent, recv := counts[r].Sent(collective.OpAllReduce), counts[1-r].Received(collective.OpAllReduce)
		// Each rank sends half the buffer in reduce-scatter and half in all-gather: n floats,
		// 4 bytes each, in 4 KiB pieces, each with a header.
		payload := uint64(4 * n)
		frames := payload / (4 << 10)
		if want := payload + frames*collective.HeaderSize; sent != want || recv != want {
			t.Errorf("rank %d sent %d bytes, rank %d received %d; want %d", r, sent, 1-r, recv, want)
		}
	}
	e, err := New(Options{Rank: 0, World: 2, Wire: counts[0], NoRuntime: true})
	if err != nil {
		t.Fatal(err)
	}
	want := 4*n + 4*collective.HeaderSize
	if err := testutil.GatherAndCompare(e.Gatherer(), strings.NewReader(`
# HELP qvd_collective_sent_bytes_total Bytes this rank sent for collectives, frame headers included, by op.
# TYPE qvd_collective_sent_bytes_total counter
qvd_collective_sent_bytes_total{op="all_gather",rank="0"} 0
qvd_collective_sent_bytes_total{op="all_reduce",rank="0"} `+strconv.Itoa(want)+`
qvd_collective_sent_bytes_total{op="barrier",rank="0"} 0
qvd_collective_sent_bytes_total{op="broadcast",rank="0"} 0
qvd_collective_sent_bytes_total{op="reduce_scatter",rank="0"} 0
`), "qvd_collective_sent_bytes_total"); err != nil {
		t.Fatal(err)
	}
}

func isDirect(t collective.Transport) bool { _, ok := t.(collective.DirectReceiver); return ok }

// TestServer serves the registry over HTTP on a free port, with the runtime collectors.
func TestServer(t *testing.T) {
	e, err := New(Options{Rank: 0, World: 1})
	if err != nil {
		t.Fatal(err)
	}
	_ = e.Write(metrics.Record{Kind: metrics.KindTrain, Step: 3, Loss: 2.5})
	s, err := e.Listen("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	resp, err := http.Get("http://" + s.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range []string{`qvd_loss{rank="0"} 2.5`, `qvd_step{rank="0"} 3`, `go_goroutines{rank="0"}`, `process_resident_memory_bytes{rank="0"}`} {
		if !strings.Contains(string(body), line) {
			t.Errorf("/metrics lacks %s:\n%s", line, body)
		}
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}
