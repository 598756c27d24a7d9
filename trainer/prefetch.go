package trainer

import (
	"context"
	"fmt"

	"github.com/qvd/qvd/data"
)

// prefetchState fills the training micro-batches ahead of the step (data.prefetch > 0). The
// prefetcher is given the rest of the current epoch as one sequence, starting at the trainer's
// position; whenever the position it expects and the trainer's differ — a new epoch, a resumed
// run, a micro-batch halved by memory adaptation — it is restarted (recreated for a new
// micro-batch size) from the trainer's position, so the batches are always the ones the
// synchronous path would fill.
type prefetchState struct {
	depth int
	pf    *data.Prefetcher // nil until the first micro-batch, and with depth 0
	epoch int              // the epoch of pf's sequence
	next  int              // the epoch position (first sample, over all ranks) pf delivers next
}

// nextMicroBatch makes t.data.batch micro-batch j of the step starting at t.pos.offset: filled here
// with data.prefetch 0, taken from the prefetcher otherwise.
func (t *Trainer) nextMicroBatch(cctx context.Context, j int) error {
	m := t.cfg.MicroBatch
	if t.data.samples != nil {
		if err := t.data.samples.record(t, j, data.MicroBatch(t.data.perm, t.pos.offset, j, t.group.world, t.group.rank, m)); err != nil {
			return err
		}
	}
	if t.prefetch.depth == 0 {
		return t.data.train.FillAugmented(t.data.batch, data.MicroBatch(t.data.perm, t.pos.offset, j, t.group.world, t.group.rank, m), t.data.norm, data.Draw{Seed: t.spec.seed, Epoch: t.pos.epoch})
	}
	p := &t.prefetch
	pos := t.pos.offset + j*t.group.world*m
	if p.pf == nil || p.pf.MicroBatch() != m || p.epoch != t.pos.epoch || p.next != pos {
		if err := t.startPrefetch(j); err != nil {
			return err
		}
	}
	b, err := p.pf.Next(cctx)
	if err != nil {
		return err
	}
	p.next += t.group.world * m
	t.data.batch = b
	return nil
}

// startPrefetch (re)starts the prefetcher at micro-batch j of the current step, with the rest
// of the epoch, up to the run's last step, as its sequence.
func (t *Trainer) startPrefetch(j int) error {
	p := &t.prefetch
	m := t.cfg.MicroBatch
	if p.pf != nil && p.pf.MicroBatch() != m {
		p.pf.Close()
		p.pf = nil
	}
	if p.pf == nil {
		pf, err := data.NewPrefetcher(t.data.train, t.data.norm, m, p.depth)
		if err != nil {
			return err
		}
		p.pf = pf
	}
	// Micro-batch j+k of the step at offset is, by MicroBatch's arithmetic, micro-batch k of
	// the sequence, also past the end of the step (global = world·m·accum). The closure reads
	// only copies and t.data.perm, which Run rewrites for the next epoch only after stopPrefetch.
	perm, offset, world, rank := t.data.perm, t.pos.offset, t.group.world, t.group.rank
	steps := min(int64((len(perm)-offset)/t.spec.global), t.spec.totalSteps-t.pos.step)
	seq := data.Sequence{
		Len:     int(steps)*t.cfg.Accum - j,
		Indices: func(k int) []int32 { return data.MicroBatch(perm, offset, j+k, world, rank, m) },
		Draw:    &data.Draw{Seed: t.spec.seed, Epoch: t.pos.epoch}, // data.augment's randomness
	}
	if err := p.pf.Start(seq); err != nil {
		return fmt.Errorf("starting the prefetch at step %d: %w", t.pos.step+1, err)
	}
	p.epoch, p.next = t.pos.epoch, t.pos.offset+j*world*m
	return nil
}

// stopPrefetch stops the producer, so nothing reads t.data.perm any more; the next micro-batch
// starts a new sequence.
func (t *Trainer) stopPrefetch() {
	if t.prefetch.pf != nil {
		t.prefetch.pf.Stop()
		t.prefetch.next = -1
	}
}

// closePrefetch ends the prefetcher for good; safe to call twice.
func (t *Trainer) closePrefetch() {
	if t.prefetch.pf != nil {
		t.prefetch.pf.Close()
		t.prefetch.pf = nil
	}
}
