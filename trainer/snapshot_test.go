package trainer

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/model"
	"github.com/qvd/qvd/optim"
)

// shardAtStep is one rank's state at a step boundary, copied in its metrics sink.
type shardAtStep struct {
	master []float32
	opt    [][]float32
	pos    SnapshotPosition
}

// captureSink records its trainer's shard after every step, and makes its rank die (its
// transport killed) once it has written the record of step killAt.
type captureSink struct {
	tr        *Trainer
	steps     map[int64]shardAtStep
	killAt    int64
	kill      func()
	closeComm func() // its rank's ring and transport
	snap      *Snapshot
	onStep    func() // if set, called instead of copying the shard
}

// runAndSnap runs every rank's trainer, takes its snapshot once Run has returned and, after a
// failure, closes its communicator, as a member of a job does before it re-forms (so its
// neighbours see it go, rather than wait out the timeout).
func runAndSnap(trainers []*Trainer, sinks []*captureSink) []error {
	errs := make([]error, len(trainers))
	var wg sync.WaitGroup
	for i, tr := range trainers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = tr.Run(context.Background())
			sinks[i].snap = tr.Snapshot()
			if errs[i] != nil {
				// Only a failed rank leaves early; the others' communicators close at the
				// test's cleanup.
				sinks[i].closeComm()
			}
		}()
	}
	wg.Wait()
	return errs
}

func (c *captureSink) Write(rec metrics.Record) error {
	if rec.Kind != metrics.KindTrain {
		return nil
	}
	if c.onStep != nil {
		c.onStep()
		return nil
	}
	t := c.tr
	s := shardAtStep{master: append([]float32(nil), t.eng.Master()...),
		pos: SnapshotPosition{Step: t.pos.step, Epoch: t.pos.epoch, Offset: t.pos.offset, Skipped: t.pos.skipped, OptimizerSteps: t.eng.Optimizer().Steps()}}
	for _, nb := range optim.ExportState(t.eng.Optimizer()) {
		s.opt = append(s.opt, append([]float32(nil), nb.Data...))
	}
	if t.scaler != nil {
		st := t.scaler.State()
		s.pos.Scaler = &st
	}
	c.steps[rec.Step] = s
	if c.kill != nil && rec.Step == c.killAt {
		c.kill()
	}
	return nil
}

// snapGroup builds n trainers of r over an in-process ring, with neighbour snapshots every
// `every` steps, each writing to a captureSink.
func (r testRun) snapGroup(t *testing.T, n, every int, chunkBytes ...int) ([]*Trainer, []*captureSink, *collective.InprocNet) {
	t.Helper()
	net, transports := collective.NewInproc(n, 1)
	cfg := collective.Config{Transport: "inproc", Timeout: 5 * time.Second, ChunkBytes: 4 << 10}
	if len(chunkBytes) > 0 {
		cfg.ChunkBytes, cfg.Timeout = chunkBytes[0], time.Minute
	}
	trainers := make([]*Trainer, n)
	sinks := make([]*captureSink, n)
	for rank := range n {
		ring, err := collective.NewRing(transports[rank], cfg)
		if err != nil {
			t.Fatal(err)
		}
		sinks[rank] = &captureSink{closeComm: func() { ring.Close(); transports[rank].Close() }}
		t.Cleanup(sinks[rank].closeComm)
		spec, err := model.NewSpec(r.model, []int{r.train.C, r.train.H, r.train.W}, r.train.Classes)
		if err != nil {
			t.Fatal(err)
		}
		layout := model.NewLayoutFrozen(spec, r.freeze)
		params := make([]float32, layout.Size)
		model.Init(spec, layout, params, r.seed)
		sinks[rank].steps = map[int64]shardAtStep{}
		tr, err := New(Setup{
			Config: r.cfg, Schedule: r.sched, Scaler: r.scaler, Optimizer: r.opt, Zero: r.zero, Seed: r.seed,
			Model: cpuModel(r)(t, spec, layout, params), Train: r.train, Test: r.test, Normalize: data.Normalize{Mean: 0.5, Std: 0.25},
			Metrics: sinks[rank], Comm: ring, SnapshotEvery: every,
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close() })
		sinks[rank].tr, trainers[rank] = tr, tr
	}
	return trainers, sinks, net
}

// assembleAll runs Assemble on a new in-process group, one member per snapshot (nil: a
// newcomer).
func assembleAll(t *testing.T, snaps []*Snapshot) ([]*State, []error) {
	t.Helper()
	n := len(snaps)
	_, transports := collective.NewInproc(n, 2)
	states, errs := make([]*State, n), make([]error, n)
	var wg sync.WaitGroup
	for r := range n {
		ring, err := collective.NewRing(transports[r], collective.Config{Transport: "inproc", Timeout: 2 * time.Second, ChunkBytes: 4 << 10})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ring.Close(); transports[r].Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			states[r], errs[r] = Assemble(context.Background(), ring, snaps[r])
		}()
	}
	wg.Wait()
	return states, errs
}

func sameBits(a, b []float32) (int, bool) {
	if len(a) != len(b) {
		return -1, false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i, false
		}
	}
	return 0, true
}

// TestSnapshotAssemble: four ranks train at ZeRO stage 1-2 with neighbour snapshots, one
// dies after some step; the survivors (and a newcomer) assemble the whole state from their
// snapshots, and it is bit for bit the group's state at the step chosen, no more than
// every steps before the last completed one.
func TestSnapshotAssemble(t *testing.T) {
	for _, c := range []struct {
		stage    int
		offload  bool
		prec     string
		opt      string
		every    int
		victim   int
		killAt   int64
		newcomer bool
		freeze   bool
	}{
		{stage: 2, prec: "fp32", opt: "adamw", every: 1, victim: 2, killAt: 5},
		{stage: 2, prec: "bf16", opt: "adamw", every: 2, victim: 0, killAt: 6, newcomer: true},
		{stage: 2, prec: "fp16", opt: "sgd", every: 1, victim: 3, killAt: 4, freeze: true},
		{stage: 1, offload: true, prec: "bf16", opt: "adamw", every: 3, victim: 1, killAt: 7},
	} {
		name := fmt.Sprintf("stage%d/%s/%s/every%d/victim%d", c.stage, c.prec, c.opt, c.every, c.victim)
		if c.offload {
			name += "/offload"
		}
		t.Run(name, func(t *testing.T) {
			const n = 4
			r := defaultRun()
			r.zero.Stage = c.stage
			r.zero.OffloadOptimizer.Device = "none"
			if c.offload {
				r.zero.OffloadOptimizer.Device = "cpu"
			}
			r.cfg.Precision, r.cfg.MicroBatch, r.cfg.MaxSteps = c.prec, 4, 1000
			r.opt.Type = c.opt
			if c.opt == "sgd" {
				r.opt.LR, r.opt.Momentum = 0.05, 0.9
			}
			if c.freeze {
				r.freeze = func(name string) bool { return strings.HasPrefix(name, "fc1.") }
			}
			trainers, sinks, net := r.snapGroup(t, n, c.every)
			sinks[c.victim].killAt, sinks[c.victim].kill = c.killAt, func() { net.Kill(c.victim) }
			start := time.Now()
			errs := runAndSnap(trainers, sinks)
			if took := time.Since(start); took > 3*time.Second {
				t.Errorf("the ranks took %v to fail", took)
			}
			for rank, err := range errs {
				if err == nil {
					t.Fatalf("rank %d finished the run", rank)
				}
			}
			var snaps []*Snapshot
			if c.newcomer {
				snaps = append(snaps, nil)
			}
			last := int64(0)
			for rank := range n {
				if rank != c.victim {
					snaps = append(snaps, sinks[rank].snap)
					last = max(last, trainers[rank].Step())
				}
			}
			states, errs := assembleAll(t, snaps)
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			s := states[0]
			// A snapshot's ship is awaited before the next step is applied: a recovery loses at
			// most the interval.
			if lost := last - s.Step; lost < 0 || lost > int64(c.every) {
				t.Fatalf("assembled step %d, the survivors reached %d: %d steps lost, want at most %d", s.Step, last, lost, c.every)
			}
			t.Logf("assembled step %d (killed after step %d, survivors at %d)", s.Step, c.killAt, last)
			// The reference: every rank's shard as its sink copied it at that step.
			lay := trainers[0].layout
			shards := trainers[0].snap.shards
			want := sinks[0].steps[s.Step]
			if s.OptimizerSteps != want.pos.OptimizerSteps || s.Epoch != want.pos.Epoch || s.Offset != want.pos.Offset ||
				s.Skipped != want.pos.Skipped || (want.pos.Scaler == nil) != (s.Scaler == nil) || (s.Scaler != nil && *s.Scaler != *want.pos.Scaler) {
				t.Fatalf("position %+v scaler %v, want %+v", s, s.Scaler, want.pos)
			}
			if c.freeze && lay.Frozen == 0 {
				t.Fatal("nothing frozen")
			}
			if i, ok := sameBits(s.Master[:lay.Frozen], trainers[0].frozenWeights()); !ok {
				t.Fatalf("frozen weight %d differs", i)
			}
			for q := range n {
				ref, ok := sinks[q].steps[s.Step]
				if !ok {
					t.Fatalf("rank %d recorded no step %d", q, s.Step)
				}
				lo, hi := shards[q], shards[q+1]
				if i, ok := sameBits(s.Master[lay.Frozen+lo:lay.Frozen+hi], ref.master); !ok {
					t.Fatalf("old rank %d's master weights differ at %d", q, i)
				}
				for b, buf := range s.Optimizer {
					if i, ok := sameBits(buf.Data[lo:hi], ref.opt[b]); !ok {
						t.Fatalf("old rank %d's %s differs at %d", q, buf.Name, i)
					}
				}
			}
			for r := 1; r < len(states); r++ {
				if _, ok := sameBits(states[r].Master, s.Master); !ok || states[r].Step != s.Step {
					t.Fatalf("member %d assembled another state", r)
				}
			}
			// The state builds the next generation's trainer (stage 0 over the survivors).
			next := r
			next.zero.Stage, next.cfg.MaxSteps = 0, s.Step+2
			tr := next.build(t, nil, nil)
			tr.Close()
		})
	}
}

// TestSnapshotTwoNeighboursLost: with two adjacent ranks gone, Assemble says so, wrapping
// ErrNoSnapshot, for the caller to fall back to a checkpoint.
func TestSnapshotTwoNeighboursLost(t *testing.T) {
	const n = 4
	r := defaultRun()
	r.zero.Stage, r.cfg.MicroBatch, r.cfg.MaxSteps = 2, 4, 1000
	trainers, sinks, net := r.snapGroup(t, n, 1)
	sinks[1].killAt, sinks[1].kill = 3, func() { net.Kill(1); net.Kill(2) }
	runAndSnap(trainers, sinks)
	_, errs := assembleAll(t, []*Snapshot{sinks[0].snap, sinks[3].snap})
	var me *MissingShardsError
	// Which shards the newest step lacks depends on how far each rank got; old rank 1's is
	// lost at every step.
	if !errors.As(errs[0], &me) || !errors.Is(errs[0], ErrNoSnapshot) || !slices.Contains(me.Missing, 1) && !slices.Contains(me.Missing, 2) {
		t.Fatalf("want a MissingShardsError naming old rank 1 or 2, got %v", errs[0])
	}
}

// TestSnapshotAuto: the measured interval is chosen after the calibration snapshots, the
// same on every rank, and a run that ends normally leaves no ship behind.
func TestSnapshotAuto(t *testing.T) {
	const n = 3
	r := defaultRun()
	r.zero.Stage, r.cfg.MicroBatch, r.cfg.MaxSteps = 2, 4, 2*snapshotCalibrate+4
	trainers, sinks, _ := r.snapGroup(t, n, SnapshotAuto)
	if errs := runAndSnap(trainers, sinks); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	for rank, tr := range trainers {
		s := tr.snap
		if s.every < 1 || s.every != trainers[0].snap.every {
			t.Fatalf("rank %d chose every %d steps, rank 0 %d", rank, s.every, trainers[0].snap.every)
		}
		if len(s.meas.with) != snapshotCalibrate || len(s.meas.without) != snapshotCalibrate || len(s.meas.ships) != snapshotCalibrate {
			t.Fatalf("rank %d measured %d steps with a snapshot, %d without and %d ships", rank, len(s.meas.with), len(s.meas.without), len(s.meas.ships))
		}
		snap := sinks[rank].snap
		if len(snap.Own) == 0 || len(snap.Peer) == 0 || snap.Own[0].Step < snapshotCalibrate-1 {
			t.Fatalf("rank %d holds %d own and %d peer snapshots, newest %d", rank, len(snap.Own), len(snap.Peer), snap.Own[0].Step)
		}
	}
}

// TestSnapshotCost measures what neighbour snapshots cost on the 36.8M-parameter MLP
// (784-4096-4096-4096-10) at 4 in-process ranks, ZeRO stage 2: the median step time without
// snapshots, with one every step, and with the interval SnapshotAuto chooses. It takes
// minutes and gigabytes, so it runs only when asked:
//
//	QVD_SNAPSHOT_COST=1 go test -run TestSnapshotCost -v -timeout 30m ./trainer/
func TestSnapshotCost(t *testing.T) {
	if testing.Short() || os.Getenv("QVD_SNAPSHOT_COST") == "" {
		t.Skip("set QVD_SNAPSHOT_COST=1 to measure the snapshots' cost (minutes, ~4 GB)")
	}
	const n, steps = 4, 18
	r := defaultRun()
	r.model = model.Config{Type: model.TypeMLP, Hidden: []int{4096, 4096, 4096}}
	r.zero.Stage = 2
	r.zero.ReduceBucketSize, r.zero.AllgatherBucketSize = 0, 0 // sized from the model and the world
	r.cfg.MicroBatch, r.cfg.MaxSteps, r.cfg.Epochs, r.cfg.EvalBatch = 16, steps, 1, 16
	r.train, r.test = synthetic784(n*16*(steps+1), 1), synthetic784(16, 2)
	if p := os.Getenv("QVD_SNAPSHOT_PRECISION"); p != "" {
		r.cfg.Precision = p
	}
	for _, every := range []int{0, 1, SnapshotAuto} {
		t.Run(fmt.Sprint(every), func(t *testing.T) { snapshotCost(t, r, n, every) })
	}
}

// snapshotCost is one configuration of TestSnapshotCost: the models are freed at the end of
// its subtest.
func snapshotCost(t *testing.T, r testRun, n, every int) {
	{
		trainers, sinks, _ := r.snapGroup(t, n, every, collective.DefaultConfig().ChunkBytes)
		var mu sync.Mutex
		var stamps []time.Time
		sinks[0].onStep = func() { mu.Lock(); stamps = append(stamps, time.Now()); mu.Unlock() }
		if errs := runAndSnap(trainers, sinks); errors.Join(errs...) != nil {
			t.Fatal(errors.Join(errs...))
		}
		var d []time.Duration
		for i := 3; i < len(stamps); i++ { // past the first steps' warm-up
			d = append(d, stamps[i].Sub(stamps[i-1]))
		}
		line := fmt.Sprintf("snapshot_every %d: median step %v over %d steps", every, median(d).Round(time.Millisecond), len(d))
		if s := trainers[0].snap; s != nil {
			line += fmt.Sprintf(", interval %d, async %v", s.every, s.async)
			if every == SnapshotAuto {
				line += fmt.Sprintf(", calibration: step %v with a snapshot, %v without; copy %v, ship %v", median(s.meas.with).Round(time.Millisecond),
					median(s.meas.without).Round(time.Millisecond), median(s.meas.copies).Round(time.Millisecond), median(s.meas.ships).Round(time.Millisecond))
			}
		}
		t.Log(line)
	}
}

// synthetic784 is synthetic data shaped as MNIST: 1×28×28 images in 10 classes.
func synthetic784(n int, seed uint64) *data.Dataset {
	const side, classes = 28, 10
	d := &data.Dataset{Name: "synthetic784", N: n, C: 1, H: side, W: side, Classes: classes,
		Images: make([]uint8, n*side*side), Labels: make([]uint8, n)}
	x := seed
	for i := range d.Images {
		x = x*6364136223846793005 + 1442695040888963407
		d.Images[i] = uint8(x >> 56)
	}
	for s := range d.Labels {
		d.Labels[s] = uint8(s % classes)
	}
	return d
}

// TestSnapshotPlan: which hooks take a snapshot or end the calibration, and so which steps
// let the parameters' all-gather run on under the next forward pass.
func TestSnapshotPlan(t *testing.T) {
	for _, c := range []struct {
		name               string
		every, taken, hook int
		last, step         int64
		due, choose, quiet bool
	}{
		{name: "first hook", every: 3, hook: 0, step: 1, due: true},
		{name: "between snapshots", every: 3, taken: 1, hook: 1, last: 1, step: 3, quiet: true},
		{name: "interval reached", every: 3, taken: 1, hook: 3, last: 1, step: 4, due: true},
		{name: "past the interval (resumed)", every: 3, taken: 2, hook: 2, last: 4, step: 9, due: true},
		{name: "every step", every: 1, taken: 5, hook: 5, last: 5, step: 6, due: true},
		{name: "auto, calibration snapshot", hook: snapshotCalibrate - 1, step: snapshotCalibrate, due: true},
		{name: "auto, calibration without", taken: snapshotCalibrate, hook: snapshotCalibrate, last: snapshotCalibrate, step: snapshotCalibrate + 1, quiet: true},
		{name: "auto, last without", taken: snapshotCalibrate, hook: 2 * snapshotCalibrate, last: snapshotCalibrate, step: 2*snapshotCalibrate + 1, quiet: true},
		{name: "auto, choosing", taken: snapshotCalibrate, hook: 2*snapshotCalibrate + 1, last: snapshotCalibrate, step: 2*snapshotCalibrate + 2, choose: true},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &snapshotter{every: c.every, taken: c.taken, hooks: c.hook, last: c.last}
			due, choose := s.plan(c.hook, c.step)
			if due != c.due || choose != c.choose {
				t.Fatalf("plan: due %v, choose %v; want %v, %v", due, choose, c.due, c.choose)
			}
			if q := s.quiet(c.step); q != c.quiet {
				t.Fatalf("quiet %v, want %v", q, c.quiet)
			}
		})
	}
}

// syncRecorder records the steps after which the step loop (or an evaluation) waited for the
// parameters' all-gather.
type syncRecorder struct {
	StepEngine
	tr    *Trainer
	steps []int64
}

func (s *syncRecorder) SyncParams() error {
	if len(s.steps) == 0 || s.steps[len(s.steps)-1] != s.tr.pos.step {
		s.steps = append(s.steps, s.tr.pos.step)
	}
	return s.StepEngine.SyncParams()
}

// TestSnapshotKeepsPrefetch: with neighbour snapshots every 3 steps the all-gather is waited
// for only after the steps whose hook takes one (1, 4) and at the end (7); the steps between
// leave it to the next forward pass, beside the ship of the last snapshot.
func TestSnapshotKeepsPrefetch(t *testing.T) {
	const n = 4
	r := defaultRun()
	r.zero.Stage, r.cfg.MicroBatch, r.cfg.MaxSteps = 2, 4, 7
	trainers, sinks, _ := r.snapGroup(t, n, 3)
	recs := make([]*syncRecorder, n)
	for i, tr := range trainers {
		recs[i] = &syncRecorder{StepEngine: tr.stepper, tr: tr}
		tr.stepper = recs[i]
	}
	if errs := runAndSnap(trainers, sinks); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	for rank, rec := range recs {
		if want := []int64{1, 4, 7}; !slices.Equal(rec.steps, want) {
			t.Fatalf("rank %d waited for the all-gather after steps %v, want %v", rank, rec.steps, want)
		}
		if s := sinks[rank].snap; len(s.Own) == 0 || s.Own[0].Step != 7 {
			t.Fatalf("rank %d: newest own snapshot %v, want step 7", rank, s.Own)
		}
	}
}
