package main

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/qvd/qvd/trainer"
)

// microBatchFlag is --micro-batch: a number, or auto (trainer.AutoMicroBatch, resolved by
// job.ResolveAutoMicro); *p stays nil unless it is given (configs.Overrides.MicroBatch).
type microBatchFlag struct{ p **int }

func (m microBatchFlag) String() string {
	switch {
	case m.p == nil || *m.p == nil:
		return ""
	case **m.p == trainer.AutoMicroBatch:
		return "auto"
	}
	return strconv.Itoa(**m.p)
}

// Placeholder names the value in help (cli.Placeholderer).
func (microBatchFlag) Placeholder() string { return "N|auto" }

func (m microBatchFlag) Set(s string) error {
	n := trainer.AutoMicroBatch
	if s != "auto" {
		var err error
		if n, err = strconv.Atoi(s); err != nil {
			return errors.New("want a number of samples or auto")
		}
		// trainer.AutoMicroBatch (-1) is how auto is stored, so a negative number must not be
		// let through: -1 would silently mean auto. Only the word auto means auto.
		if n < 1 || n > maxMicroBatch {
			return fmt.Errorf("train.micro_batch: must be in [1, %d] or auto, got %d", maxMicroBatch, n)
		}
	}
	*m.p = &n
	return nil
}

// maxMicroBatch is trainer.Config.Validate's upper bound on train.micro_batch.
const maxMicroBatch = 1 << 20
