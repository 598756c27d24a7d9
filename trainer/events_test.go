package trainer

import (
	"context"
	"testing"

	"github.com/qvd/qvd/internal/metrics"
)

// TestOOMEventsRecorded: the steps whose micro-batches ran out of memory say how many in
// oom_skipped (and, when all did, skipped), and halving the micro-batch is an event record:
// what the dashboard lists among the run's events.
func TestOOMEventsRecorded(t *testing.T) {
	r := defaultRun()
	r.cfg.MicroBatch, r.cfg.Accum, r.cfg.MaxSteps = 16, 1, 4
	tr := r.buildOOM(t, func(micro, _ int) bool { return micro > 8 }, 2)
	rec := &recorder{}
	tr.out.metrics = rec
	if _, err := tr.Run(context.Background()); err != nil {
		t.Fatal(err)
	}
	var oom []int64
	var halved []metrics.Record
	for _, r := range rec.recs {
		switch {
		case r.Kind == metrics.KindTrain && r.OOMSkipped > 0:
			if r.OOMSkipped != 1 || !r.Skipped {
				t.Errorf("step %d: oom_skipped %d, skipped %v; want 1 and true (its only micro-batch)", r.Step, r.OOMSkipped, r.Skipped)
			}
			oom = append(oom, r.Step)
		case r.Kind == metrics.KindEvent:
			halved = append(halved, r)
		}
	}
	if len(oom) != 2 || oom[0] != 1 || oom[1] != 2 {
		t.Errorf("steps with oom_skipped: %v, want [1 2]", oom)
	}
	if len(halved) != 1 || halved[0].Event != metrics.EventMicroBatchHalved || halved[0].Step != 2 || halved[0].Detail == "" {
		t.Fatalf("events %+v, want one micro_batch_halved after step 2", halved)
	}
}
