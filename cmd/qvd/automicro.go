package main

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/qvd/qvd/trainer"
)

// microBatchFlag is --micro-batch: a number, or auto (resolved by job.ResolveAutoMicro).
type microBatchFlag int

func (m *microBatchFlag) String() string {
	if m == nil || int(*m) == 0 {
		return ""
	}
	if int(*m) == trainer.AutoMicroBatch {
		return "auto"
	}
	return strconv.Itoa(int(*m))
}

func (m *microBatchFlag) Set(s string) error {
	if s == "auto" {
		*m = trainer.AutoMicroBatch
		return nil
	}
	n, err := strconv.Atoi(s)
	if err != nil {
		return errors.New("want a number of samples or auto")
	}
	// trainer.AutoMicroBatch (-1) is how auto is stored, so a negative number must not be
	// let through: -1 would silently mean auto. Only the word auto means auto.
	if n < 1 || n > maxMicroBatch {
		return fmt.Errorf("train.micro_batch: must be in [1, %d] or auto, got %d", maxMicroBatch, n)
	}
	*m = microBatchFlag(n)
	return nil
}

// maxMicroBatch is trainer.Config.Validate's upper bound on train.micro_batch.
const maxMicroBatch = 1 << 20
