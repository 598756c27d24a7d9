package configs

import (
	"math"
	"strings"
	"testing"

	"github.com/qvd/qvd/trainer"
)

const dsFull = `{
  "train_batch_size": 64,
  "train_micro_batch_size_per_gpu": 16,
  "gradient_accumulation_steps": 4,
  "gradient_clipping": 1.0,
  "steps_per_print": 100,
  "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500, "hysteresis": 3, "min_loss_scale": 2},
  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.8, 0.99], "eps": 1e-6, "weight_decay": 0.05}},
  "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 1000, "warmup_num_steps": 100, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_type": "linear"}},
  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": true}, "reduce_bucket_size": 5e7, "allgather_bucket_size": 2e8, "overlap_comm": true}
}`

func TestDeepSpeedMapping(t *testing.T) {
	c := Default()
	res, err := ApplyDeepSpeed(&c, []byte(dsFull))
	if err != nil {
		t.Fatal(err)
	}
	if err := res.CheckBatch(&c, 1); err != nil {
		t.Fatal(err)
	}
	c.Resolve()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	tr := c.Train
	if tr.MicroBatch != 16 || tr.Accum != 4 || tr.MaxGradNorm != 1 || tr.Precision != "fp16" {
		t.Fatalf("train: %+v", tr)
	}
	if f := c.FP16; f.InitialScalePower != 12 || f.Window != 500 || f.Hysteresis != 3 || f.MinScale != 2 || f.LossScale != 0 {
		t.Fatalf("fp16: %+v", f)
	}
	if o := c.Optimizer; o.Type != "adamw" || o.LR != 3e-4 || o.Betas != [2]float64{0.8, 0.99} || o.Eps != 1e-6 || o.WeightDecay != 0.05 {
		t.Fatalf("optimizer: %+v", o)
	}
	if s := c.Scheduler; s.Type != trainer.ScheduleWarmupCosine || s.TotalSteps != 1000 || s.WarmupSteps != 100 || s.WarmupStartRatio != 0.1 || s.MinRatio != 0.01 || s.WarmupType != "linear" {
		t.Fatalf("scheduler: %+v", s)
	}
	if z := c.Zero; z.Stage != 2 || z.OffloadOptimizer.Device != "cpu" || z.ReduceBucketSize != 5e7 || z.AllgatherBucketSize != 2e8 || !z.OverlapComm {
		t.Fatalf("zero: %+v", z)
	}
	if len(res.Warnings) != 2 { // steps_per_print, pin_memory
		t.Fatalf("warnings: %q", res.Warnings)
	}
}

func TestDeepSpeedWarmupSchedulersAndAdamMode(t *testing.T) {
	c := Default()
	_, err := ApplyDeepSpeed(&c, []byte(`{"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": false, "weight_decay": 0.1}},
		"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "total_num_steps": 100}},
		"bf16": {"enabled": true}}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Optimizer.Type != "adam" || c.Optimizer.WeightDecay != 0.1 {
		t.Fatalf("Adam with adam_w_mode false should be L2 Adam: %+v", c.Optimizer)
	}
	s := c.Scheduler
	if s.Type != trainer.ScheduleWarmupLinear || s.WarmupType != "log" || math.Abs(s.WarmupStartRatio-0.01) > 1e-12 || math.Abs(s.MinRatio-0.01) > 1e-12 || c.Optimizer.LR != 1e-3 {
		t.Fatalf("WarmupDecayLR: %+v lr %v", s, c.Optimizer.LR)
	}
	if c.Train.Precision != "bf16" {
		t.Fatalf("bf16 not enabled: %q", c.Train.Precision)
	}
	c2 := Default()
	if _, err := ApplyDeepSpeed(&c2, []byte(`{"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}`)); err != nil || c2.Optimizer.Type != "adamw" {
		t.Fatalf("DeepSpeed's Adam defaults to AdamW mode: %v %+v", err, c2.Optimizer)
	}
}

func TestDeepSpeedBatchDerivation(t *testing.T) {
	cases := []struct {
		json         string
		world        int
		micro, accum int
		wantErr      string
	}{
		{`{"train_batch_size": 64}`, 2, 32, 1, ""},
		{`{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}`, 2, 8, 4, ""},
		{`{"train_batch_size": 64, "gradient_accumulation_steps": 2}`, 4, 8, 2, ""},
		{`{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2}`, 1, 0, 0, "must equal"},
		{`{"train_batch_size": 60, "train_micro_batch_size_per_gpu": 8}`, 1, 0, 0, "not divisible"},
		{`{"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 8}`, 1, 8, 1, ""},
	}
	for _, tc := range cases {
		c := Default()
		res, err := ApplyDeepSpeed(&c, []byte(tc.json))
		if err == nil {
			err = res.CheckBatch(&c, tc.world)
		}
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%s: want error %q, got %v", tc.json, tc.wantErr, err)
			}
			continue
		}
		if err != nil || c.Train.MicroBatch != tc.micro || c.Train.Accum != tc.accum {
			t.Errorf("%s (world %d): micro %d accum %d err %v, want %d×%d", tc.json, tc.world, c.Train.MicroBatch, c.Train.Accum, err, tc.micro, tc.accum)
		}
	}
}

func TestDeepSpeedRejectsWhatItCannotHonour(t *testing.T) {
	cases := map[string]string{
		`{"activation_checkpointing": {}}`:                                      "activation_checkpointing",
		`{"optimizer": {"type": "Lamb", "params": {}}}`:                         "Lamb",
		`{"optimizer": {"type": "AdamW", "params": {"amsgrad": true}}}`:         "optimizer.params.amsgrad",
		`{"scheduler": {"type": "OneCycle", "params": {}}}`:                     "OneCycle",
		`{"scheduler": {"type": "WarmupLR", "params": {"total_num_steps": 5}}}`: "scheduler.params.total_num_steps",
		`{"fp16": {"enabled": true, "auto_cast": true}}`:                        "fp16.auto_cast",
		`{"fp16": {"enabled": true}, "bf16": {"enabled": true}}`:                "cannot both",
		`{"zero_optimization": {"stage": 2, "offload_param": {}}}`:              "zero_optimization.offload_param",
		`{"gradient_clipping": "big"}`:                                          "gradient_clipping",
		`[1]`:                                                                   "top level",
		`{"train_micro_batch_size_per_gpu": 0}`:                                 "train_micro_batch_size_per_gpu",
	}
	for js, want := range cases {
		c := Default()
		_, err := ApplyDeepSpeed(&c, []byte(js))
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: want an error naming %q, got %v", js, want, err)
		}
	}
}
