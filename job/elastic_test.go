package job

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/trainer"
)

// inprocGroup is an elastic membership for the ranks of one test process: Reform is a
// barrier of the ranks still alive, which then get the next generation's in-process ring.
type inprocGroup struct {
	mu    sync.Mutex
	gen   uint64
	alive []int // original ids in rank order
	dead  map[int]bool
	// waiting are the arrivals for generation gen+1 and the channel closed when it forms.
	waiting map[int]bool
	formed  chan struct{}
	next    map[int]Generation
	// newcomers wait to join from the admitAt-th time Newcomers is asked (a step of rank
	// 0); the next generation formed gives each of them its place on admitted.
	newcomers []int
	admitAt   int
	asked     int
	admitted  chan Generation
	// leave closes a member's first generation's ring as it re-forms (a real member closes
	// its data plane then, which breaks its peers' connections at once).
	leave map[int]func()
}

func newInprocGroup(n int) *inprocGroup {
	g := &inprocGroup{dead: map[int]bool{}, waiting: map[int]bool{}, formed: make(chan struct{}), leave: map[int]func(){}}
	for i := range n {
		g.alive = append(g.alive, i)
	}
	return g
}

// member is rank id's Membership.
func (g *inprocGroup) member(id int) Membership { return &inprocMember{g: g, id: id} }

func (g *inprocGroup) kill(id int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.dead[id] = true
	var alive []int
	for _, a := range g.alive {
		if a != id {
			alive = append(alive, a)
		}
	}
	g.alive = alive
}

type inprocMember struct {
	g  *inprocGroup
	id int
}

func (m *inprocMember) Watch(lost func(error)) func() { return func() {} } // the transport reports the loss

func (m *inprocMember) Newcomers() int {
	g := m.g
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.asked++; g.asked < g.admitAt {
		return 0
	}
	return len(g.newcomers)
}

func (m *inprocMember) Reform(ctx context.Context, cause error, min, max int, wait time.Duration) (Generation, error) {
	g := m.g
	g.mu.Lock()
	if leave := g.leave[m.id]; leave != nil {
		delete(g.leave, m.id)
		leave()
	}
	if g.dead[m.id] {
		g.mu.Unlock()
		return Generation{}, fmt.Errorf("rank %d was dropped from the group: %w", m.id, cause)
	}
	if len(g.alive) < min {
		g.mu.Unlock()
		return Generation{}, fmt.Errorf("%d members remain, fewer than min_nodes %d: %w", len(g.alive), min, cause)
	}
	g.waiting[m.id] = true
	formed := g.formed
	if len(g.waiting) == len(g.alive) {
		for len(g.newcomers) > 0 && len(g.alive) < max {
			g.alive, g.newcomers = append(g.alive, g.newcomers[0]), g.newcomers[1:]
		}
		_, ts := collective.NewInproc(len(g.alive), 1)
		g.gen++
		g.next = map[int]Generation{}
		for r, id := range g.alive {
			ring, err := collective.NewRing(ts[r], collective.DefaultConfig())
			if err != nil {
				g.mu.Unlock()
				return Generation{}, err
			}
			tr := ts[r]
			g.next[id] = Generation{Gen: g.gen, Rank: r, World: len(g.alive), Comm: ring, Close: func() { ring.Close(); tr.Close() }}
		}
		for _, id := range g.alive {
			if !g.waiting[id] {
				g.admitted <- g.next[id] // buffered
			}
		}
		g.waiting = map[int]bool{}
		close(g.formed)
		g.formed = make(chan struct{})
	}
	g.mu.Unlock()
	select {
	case <-formed:
	case <-ctx.Done():
		return Generation{}, ctx.Err()
	case <-time.After(30 * time.Second):
		return Generation{}, errors.New("test: the group did not re-form")
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.next[m.id], nil
}

// killAt is a rank's communicator that dies as it enters the step counters' all-reduce of
// step `at` (trainer: one five-counter AllReduceInt64 per step, after the gradient's
// reduction): every rank has completed step at-1 — and its checkpoint — and none can apply
// step at.
type killAt struct {
	collective.Communicator
	net   *collective.InprocNet
	group *inprocGroup
	rank  int
	at    int
	calls int
}

func (k *killAt) AllReduceInt64(ctx context.Context, v []int64, op collective.Op) error {
	if len(v) == 5 {
		if k.calls++; k.calls == k.at {
			k.group.kill(k.rank)
			k.net.Kill(k.rank)
			return fmt.Errorf("test: rank %d killed at step %d: %w", k.rank, k.at, collective.ErrClosed)
		}
	}
	return k.Communicator.AllReduceInt64(ctx, v, op)
}

// Shift keeps the ring's own neighbour shift (the snapshots') behind the wrapper.
func (k *killAt) Shift(ctx context.Context, send, recv []float32, c collective.Call) error {
	return collective.Shift(ctx, k.Communicator, send, recv, c)
}

// elasticConfig is testConfig's job at world 3 (micro 2 × accum 2: global batch 12), elastic
// down to 2 ranks, checkpointing every 3 steps.
func elasticConfig(t *testing.T, dir, out string, stage, accum int) configs.Config {
	t.Helper()
	text := fmt.Sprintf(`run: {name: elastic, seed: 7, out: %q}
model: {type: mlp, hidden: [16]}
data: {path: %q, cache: none}
train: {micro_batch: 2, accum: %d, epochs: 1, max_steps: 8, eval_batch: 16, threads: 1}
optimizer: {type: adamw, lr: 0.01}
zero_optimization: {stage: %d}
checkpoint: {every_steps: 3, keep: 10}
elastic: {min_nodes: 2, max_nodes: 3, settle: 0s}
`, out, dir, accum, stage)
	return parseConfig(t, text)
}

// TestElasticLosesARank runs 3 ranks through Run, kills rank 2 at a step boundary, and checks
// that the 2 survivors re-form, keep the global batch (accum 2 → 3), finish, and end with the
// weights — bit for bit — of a fresh run at world 2 resumed from the same state: stage 0
// continues from memory at the step of the loss; stages 1 and 2 (with and without the
// optimizer offloaded) rebuild the lost shard from the neighbour snapshots (losing at most
// one step), or, with snapshots off, resume the newest checkpoint.
func TestElasticLosesARank(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	dir := synthData(t, 120, 40)
	for _, c := range []struct {
		stage    int
		killAt   int // the step rank 2 dies in
		source   string
		lost     int64 // -1: at most one step (a snapshot may still be in flight)
		fromStep int64 // the state the survivors continue from (-1: the reform record's)
		offload  bool  // the optimizer on the host (zero_optimization.offload_optimizer: cpu)
		snaps    int   // elastic.snapshot_every
	}{
		{stage: 0, killAt: 4, source: metrics.SourceMemory, lost: 0, fromStep: 3},
		{stage: 1, killAt: 5, source: metrics.SourceSnapshot, lost: -1, fromStep: -1, snaps: 1},
		{stage: 2, killAt: 5, source: metrics.SourceSnapshot, lost: -1, fromStep: -1, snaps: 1},
		{stage: 2, killAt: 5, source: metrics.SourceSnapshot, lost: -1, fromStep: -1, snaps: 1, offload: true},
		{stage: 1, killAt: 5, source: metrics.SourceCheckpoint, lost: 1, fromStep: 3, snaps: -1},
		{stage: 2, killAt: 5, source: metrics.SourceCheckpoint, lost: 1, fromStep: 3, snaps: -1, offload: true},
	} {
		name := fmt.Sprintf("stage%d-%s", c.stage, c.source)
		if c.offload {
			name += "-offload"
		}
		t.Run(name, func(t *testing.T) {
			out := t.TempDir()
			cfg := elasticConfig(t, dir, out, c.stage, 2)
			cfg.Elastic.SnapshotEvery = c.snaps
			if c.offload {
				cfg.Zero.OffloadOptimizer.Device = "cpu"
			}
			net, transports := collective.NewInproc(3, 1)
			group := newInprocGroup(3)
			res, errs := make([]trainer.Result, 3), make([]error, 3)
			var stderr [3]bytes.Buffer
			var wg sync.WaitGroup
			start := time.Now()
			for r := range 3 {
				ring, err := collective.NewRing(transports[r], collective.DefaultConfig())
				if err != nil {
					t.Fatal(err)
				}
				defer ring.Close()
				defer transports[r].Close()
				var comm collective.Communicator = ring
				if r == 2 {
					comm = &killAt{Communicator: ring, net: net, group: group, rank: 2, at: c.killAt}
				}
				tr := transports[r]
				group.leave[r] = func() { ring.Close(); tr.Close() }
				wg.Add(1)
				go func() {
					defer wg.Done()
					res[r], errs[r] = Run(context.Background(), cfg, Options{Stderr: &stderr[r], Quiet: true, Comm: comm, Membership: group.member(r), LogLevel: zapcore.InfoLevel})
				}()
			}
			wg.Wait()
			t.Logf("elastic run: %v", time.Since(start).Round(time.Millisecond))
			if errs[2] == nil || !strings.Contains(errs[2].Error(), "killed") {
				t.Fatalf("rank 2: err = %v", errs[2])
			}
			for r := range 2 {
				if errs[r] != nil {
					t.Fatalf("rank %d: %v\n%s", r, errs[r], stderr[r].String())
				}
				if res[r].Steps != 8 || res[r].Accum != 3 || res[r].WeightsSHA256 != res[0].WeightsSHA256 {
					t.Fatalf("rank %d: %d steps, accum %d, weights %s; rank 0: %s", r, res[r].Steps, res[r].Accum, res[r].WeightsSHA256, res[0].WeightsSHA256)
				}
			}
			reform := lastReform(t, cfg.MetricsPath())
			if reform == nil {
				t.Fatalf("no reform record in %s", cfg.MetricsPath())
			}
			wantFrom := c.fromStep
			if c.source == metrics.SourceMemory {
				wantFrom = int64(c.killAt - 1)
			}
			lostOK := reform.LostSteps == c.lost
			if c.lost < 0 { // a snapshot of the last step may not have reached its neighbour
				lostOK = reform.LostSteps <= 1 && reform.Step == int64(c.killAt-1)-reform.LostSteps
				wantFrom = reform.Step
			}
			if reform.World != 2 || reform.OldWorld != 3 || reform.Source != c.source || !lostOK || reform.Step != wantFrom || reform.Gen != 1 || reform.Detail == "" {
				t.Fatalf("reform record %+v", *reform)
			}
			t.Logf("reform: source %s, from step %d, lost %d, %.3f s to resume; cause: %s", reform.Source, reform.Step, reform.LostSteps, reform.ResumeSeconds, reform.Detail)
			if reform.ResumeSeconds > 10 { // a survivor left waiting out the collective timeout (20 s)
				t.Errorf("%.1f s to resume", reform.ResumeSeconds)
			}

			// The reference: a fresh run at world 2 (accum 3: the same global batch) resumed
			// from a checkpoint of the state the survivors continued from — the elastic
			// run's own, or, for a snapshot's step, one a clean world-3 run wrote at every step.
			ckptDir := cfg.Checkpoint.Dir
			if c.source == metrics.SourceSnapshot {
				clean := elasticConfig(t, dir, t.TempDir(), c.stage, 2)
				clean.Elastic.MinNodes, clean.Elastic.MaxNodes = 0, 0
				clean.Checkpoint.EverySteps = 1
				clean.Zero.OffloadOptimizer.Device = cfg.Zero.OffloadOptimizer.Device
				runGroup(t, clean, 3, "")
				ckptDir = clean.Checkpoint.Dir
			}
			ckpt := filepath.Join(ckptDir, fmt.Sprintf("step-%08d", wantFrom))
			if _, err := os.Stat(ckpt); err != nil {
				entries, _ := os.ReadDir(ckptDir)
				t.Fatalf("no checkpoint at step %d: %v (have %v)", wantFrom, err, entries)
			}
			ref := elasticConfig(t, dir, t.TempDir(), c.stage, 3)
			ref.Elastic.MinNodes, ref.Elastic.MaxNodes = 0, 0
			ref.Zero.OffloadOptimizer.Device = cfg.Zero.OffloadOptimizer.Device
			refRes := runGroup(t, ref, 2, ckpt)
			if refRes[0].Steps != 8 || refRes[0].WeightsSHA256 != res[0].WeightsSHA256 {
				t.Fatalf("the survivors end with weights %s, a fresh world-2 run resumed from %s with %s (%d steps)",
					res[0].WeightsSHA256, ckpt, refRes[0].WeightsSHA256, refRes[0].Steps)
			}
		})
	}
}

// lastReform is the last reform record of the metrics file at path (nil: none).
func lastReform(t *testing.T, path string) *metrics.Record {
	t.Helper()
	recs, err := metrics.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var reform *metrics.Record
	for i := range recs {
		if recs[i].Event == metrics.EventReform {
			reform = &recs[i]
		}
	}
	return reform
}

// runGroup runs cfg at a fixed world over in-process rings, resumed from resume if set, and
// returns every rank's result.
func runGroup(t *testing.T, cfg configs.Config, world int, resume string) []trainer.Result {
	t.Helper()
	_, ts := collective.NewInproc(world, 1)
	res, errs := make([]trainer.Result, world), make([]error, world)
	var wg sync.WaitGroup
	for r := range world {
		ring, err := collective.NewRing(ts[r], collective.DefaultConfig())
		if err != nil {
			t.Fatal(err)
		}
		defer ring.Close()
		defer ts[r].Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[r], errs[r] = Run(context.Background(), cfg, Options{Quiet: true, Comm: ring, Resume: resume, LogLevel: zapcore.WarnLevel})
		}()
	}
	wg.Wait()
	for r := range world {
		if errs[r] != nil {
			t.Fatalf("rank %d of %d: %v", r, world, errs[r])
		}
	}
	return res
}

// TestElasticAdmitsAMember runs 2 ranks of a job that may grow to 3; a third member waits
// to join from step 3. Rank 0 stops the group at that step boundary, the state is gathered
// (every stage), the group re-forms with the newcomer — which receives the state from rank
// 0 — and the 3 ranks keep the global batch (accum 3 → 2) and finish with the weights, bit
// for bit, of a fresh world-3 run resumed from the checkpoint of step 3.
func TestElasticAdmitsAMember(t *testing.T) {
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	dir := synthData(t, 120, 40)
	for _, c := range []struct {
		stage   int
		offload bool
	}{{0, false}, {1, false}, {2, false}, {2, true}} {
		stage, name := c.stage, fmt.Sprintf("stage%d", c.stage)
		if c.offload {
			name += "-offload"
		}
		t.Run(name, func(t *testing.T) {
			out := t.TempDir()
			cfg := elasticConfig(t, dir, out, stage, 3)
			if c.offload {
				cfg.Zero.OffloadOptimizer.Device = "cpu"
			}
			_, transports := collective.NewInproc(2, 1)
			group := newInprocGroup(2)
			group.newcomers, group.admitAt, group.admitted = []int{2}, 3, make(chan Generation, 1)
			res, errs := make([]trainer.Result, 3), make([]error, 3)
			var stderr [3]bytes.Buffer
			var wg sync.WaitGroup
			for r := range 2 {
				ring, err := collective.NewRing(transports[r], collective.DefaultConfig())
				if err != nil {
					t.Fatal(err)
				}
				defer ring.Close()
				defer transports[r].Close()
				wg.Add(1)
				go func() {
					defer wg.Done()
					res[r], errs[r] = Run(context.Background(), cfg, Options{Stderr: &stderr[r], Quiet: true, Comm: ring, Membership: group.member(r), LogLevel: zapcore.InfoLevel})
				}()
			}
			wg.Add(1)
			go func() { // the newcomer: it starts once the group admits it
				defer wg.Done()
				select {
				case g := <-group.admitted:
					defer g.Close()
					res[2], errs[2] = Run(context.Background(), cfg, Options{Stderr: &stderr[2], Quiet: true, Comm: g.Comm, Membership: group.member(2), LogLevel: zapcore.InfoLevel})
				case <-time.After(60 * time.Second):
					errs[2] = errors.New("test: the newcomer was never admitted")
				}
			}()
			wg.Wait()
			for r := range 3 {
				if errs[r] != nil {
					t.Fatalf("rank %d: %v\n%s", r, errs[r], stderr[r].String())
				}
				if res[r].Steps != 8 || res[r].Accum != 2 || res[r].WeightsSHA256 != res[0].WeightsSHA256 {
					t.Fatalf("rank %d: %d steps, accum %d, weights %s; rank 0: %s", r, res[r].Steps, res[r].Accum, res[r].WeightsSHA256, res[0].WeightsSHA256)
				}
			}
			reform := lastReform(t, cfg.MetricsPath())
			if reform == nil || reform.World != 3 || reform.OldWorld != 2 || reform.Source != metrics.SourceMemory || reform.LostSteps != 0 ||
				reform.Step != 3 || reform.Detail != "admitted 1 members" || reform.ResumeSeconds <= 0 {
				t.Fatalf("reform record %+v", reform)
			}

			ckpt := filepath.Join(cfg.Checkpoint.Dir, "step-00000003")
			ref := elasticConfig(t, dir, t.TempDir(), stage, 2)
			ref.Elastic.MinNodes, ref.Elastic.MaxNodes = 0, 0
			ref.Zero.OffloadOptimizer.Device = cfg.Zero.OffloadOptimizer.Device
			refRes := runGroup(t, ref, 3, ckpt)
			if refRes[0].Steps != 8 || refRes[0].WeightsSHA256 != res[0].WeightsSHA256 {
				t.Fatalf("the grown group ends with weights %s, a fresh world-3 run resumed from %s with %s (%d steps)",
					res[0].WeightsSHA256, ckpt, refRes[0].WeightsSHA256, refRes[0].Steps)
			}
		})
	}
}
