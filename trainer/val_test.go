package trainer

import (
	"context"
	"math"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/metrics"
)

// valRun is defaultRun training on what is left of 200 samples after holding 20% out as the
// validation split, for 3 epochs.
func valRun(t *testing.T) testRun {
	t.Helper()
	r := defaultRun()
	rest, val, err := data.HoldOut(synthetic(200, 1), 0.2, r.seed)
	if err != nil {
		t.Fatal(err)
	}
	r.train, r.val = rest, val
	return r
}

// evalRecords splits a run's records into its validation and test evaluations.
func evalRecords(recs []metrics.Record) (val, test []metrics.Record) {
	for _, rec := range recs {
		switch rec.Kind {
		case metrics.KindVal:
			val = append(val, rec)
		case metrics.KindEval:
			test = append(test, rec)
		}
	}
	return val, test
}

// TestValidationSplit: with a validation split every epoch evaluates it (records of kind
// val, log lines "validation" with val_accuracy and val_loss) and the test split is
// evaluated once, at the end (kind eval, "evaluation" with test_accuracy); the result holds
// both. The held-out samples are not trained on: the run takes exactly the steps of a run on
// the remaining samples alone.
func TestValidationSplit(t *testing.T) {
	r := valRun(t)
	core, logs := observer.New(zapcore.InfoLevel)
	rec := &recorder{}
	tr := r.build(t, rec, nil)
	tr.log = zap.New(core)
	res, err := tr.Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	val, test := evalRecords(rec.recs)
	if len(val) != r.cfg.Epochs || len(test) != 1 {
		t.Fatalf("%d validation and %d test records, want %d and 1", len(val), len(test), r.cfg.Epochs)
	}
	last := val[len(val)-1]
	if test[0].Step != res.Steps || last.Step != res.Steps || val[0].Step != int64(tr.StepsPerEpoch()) {
		t.Errorf("validation at steps %d..%d, test at %d; the run took %d steps of %d per epoch", val[0].Step, last.Step, test[0].Step, res.Steps, tr.StepsPerEpoch())
	}
	if last.Samples != 40 || test[0].Samples != 100 {
		t.Errorf("validation on %d samples (want 40), test on %d (want 100)", last.Samples, test[0].Samples)
	}
	if res.ValAccuracy != last.Accuracy || res.ValLoss != last.Loss || res.TestAccuracy != test[0].Accuracy || res.TestLoss != test[0].Loss {
		t.Errorf("result val %v/%v test %v/%v; records val %v/%v test %v/%v", res.ValAccuracy, res.ValLoss, res.TestAccuracy, res.TestLoss,
			last.Accuracy, last.Loss, test[0].Accuracy, test[0].Loss)
	}
	vlogs, tlogs := logs.FilterMessage("validation").All(), logs.FilterMessage("evaluation").All()
	if len(vlogs) != r.cfg.Epochs || len(tlogs) != 1 {
		t.Fatalf("%d validation and %d evaluation log lines", len(vlogs), len(tlogs))
	}
	if f := vlogs[0].ContextMap(); f["val_accuracy"] == nil || f["val_loss"] == nil || f["test_accuracy"] != nil {
		t.Errorf("validation line fields %v", f)
	}
	if f := tlogs[0].ContextMap(); f["test_accuracy"] != res.TestAccuracy || f["val_accuracy"] != nil {
		t.Errorf("evaluation line fields %v", f)
	}

	alone := r
	alone.val = nil
	ra, err := alone.build(t, nil, nil).Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if ra.WeightsSHA256 != res.WeightsSHA256 || ra.TestAccuracy != res.TestAccuracy {
		t.Errorf("training on the remaining samples without a validation split ends elsewhere: weights %s vs %s, test accuracy %v vs %v",
			ra.WeightsSHA256[:12], res.WeightsSHA256[:12], ra.TestAccuracy, res.TestAccuracy)
	}
	full := r
	full.val, full.train = nil, synthetic(200, 1)
	rf, err := full.build(t, nil, nil).Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if rf.WeightsSHA256 == res.WeightsSHA256 {
		t.Error("training on all 200 samples gives the weights of training without the held-out 40")
	}
}

// TestValidationSplitDataParallel: two ranks at micro m reproduce one worker at micro 2m with
// a validation split: the same steps and evaluations, the same accuracies, every rank the
// same weights.
func TestValidationSplitDataParallel(t *testing.T) {
	base := valRun(t)
	base.cfg.Epochs = 2
	base.opt.Type, base.opt.LR, base.opt.Momentum = "sgd", 0.05, 0.9
	single := base
	single.cfg.MicroBatch = 16
	srec := &recorder{}
	want, err := single.build(t, srec, nil).Run(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	grp := base
	grp.cfg.MicroBatch = 8
	sinks := []MetricsSink{&recorder{}, &recorder{}}
	trainers, _ := grp.group(t, 2, sinks, nil)
	results, errs := runAll(context.Background(), trainers)
	for rank, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", rank, err)
		}
	}
	if d, at := maxAbsDiff(trainers[0].Master(), trainers[1].Master()); d != 0 {
		t.Fatalf("rank 1's weights differ from rank 0's by %g at %d", d, at)
	}
	if d, _ := maxAbsDiff(trainers[0].Master(), single.build(t, nil, nil).Master()); d == 0 {
		t.Fatal("the trained group holds the untrained weights")
	}
	sv, st := evalRecords(srec.recs)
	gv, gt := evalRecords(sinks[0].(*recorder).recs)
	if len(gv) != len(sv) || len(gt) != 1 || len(st) != 1 || results[0].Steps != want.Steps {
		t.Fatalf("group: %d validation, %d test records in %d steps; single: %d, %d in %d", len(gv), len(gt), results[0].Steps, len(sv), len(st), want.Steps)
	}
	for i := range gv {
		if gv[i].Step != sv[i].Step || gv[i].Samples != sv[i].Samples || gv[i].Accuracy != sv[i].Accuracy || math.Abs(gv[i].Loss-sv[i].Loss) > 1e-5 {
			t.Errorf("validation %d: group %+v, single %+v", i, gv[i], sv[i])
		}
	}
	if results[0].TestAccuracy != want.TestAccuracy || math.Abs(results[0].ValLoss-want.ValLoss) > 1e-5 || results[1].ValAccuracy != want.ValAccuracy {
		t.Errorf("group test %v val %v/%v, single test %v val %v/%v", results[0].TestAccuracy, results[0].ValAccuracy, results[0].ValLoss,
			want.TestAccuracy, want.ValAccuracy, want.ValLoss)
	}
}
