package data

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// MaxPrefetch bounds Config.Prefetch. Filling a micro-batch is far cheaper than computing on
// it, so a queue deeper than a few batches only holds memory; the bound catches a typo.
const MaxPrefetch = 64

// ErrSequenceDone is returned by Prefetcher.Next after the last micro-batch of the sequence
// given to Start, and before any Start.
var ErrSequenceDone = errors.New("data: prefetch: no more micro-batches in the sequence")

// ErrPrefetcherClosed is returned by Start and Next after Close.
var ErrPrefetcherClosed = errors.New("data: prefetch: prefetcher is closed")

// A Sequence names the micro-batches a consumer will take, in order: micro-batch k, for k in
// [0, Len), holds the samples Indices(k). Indices runs on the producer goroutine, so it must
// only read what stays unchanged until the sequence is done or stopped (the epoch's
// permutation, for the trainer); the slice it returns is only read, and not kept.
type Sequence struct {
	Len     int
	Indices func(k int) []int32
	// Draw, when set, fills with FillAugmented at that draw (training); nil fills with Fill.
	Draw *Draw
}

// Prefetcher fills the micro-batches of a Sequence ahead of their use: a producer goroutine
// normalises micro-batch k+1, k+2, ... into a bounded ring of batches while the consumer
// computes on micro-batch k, so filling overlaps compute. The consumer sees exactly the
// batches that Fill would give, in the same order; an error from Fill reaches it in order,
// after every batch before it, and ends the sequence.
//
// The ring holds depth+1 batches: up to depth filled ahead and the one the consumer holds.
// With depth 0 there is no goroutine and Next fills the batch itself. Nothing is allocated
// per micro-batch: batches, channels and the producer (one per sequence) are set up in
// NewPrefetcher and Start.
//
// A Prefetcher belongs to one consumer goroutine: Start, Next, Stop and Close must not be
// called concurrently. It owns its producer goroutine, which Stop and Close end and wait for.
type Prefetcher struct {
	d     *Dataset
	norm  Normalize
	depth int
	micro int

	free  chan *Batch   // batches the producer may fill
	ready chan filled   // filled batches (or an error), in sequence order
	only  *Batch        // depth 0: the one batch, filled in Next
	held  *Batch        // the batch Next last returned, given back on the next call
	stop  chan struct{} // closed by Stop; nil when no producer runs
	wg    sync.WaitGroup

	seq    Sequence
	k      int   // micro-batches handed out from the current sequence
	err    error // sticky: the error that ended the sequence
	closed bool
}

type filled struct {
	b   *Batch
	err error
}

// NewPrefetcher prepares depth+1 batches (1 when depth is 0) of micro samples from d,
// normalised with norm. Invalid arguments are an error naming them.
func NewPrefetcher(d *Dataset, norm Normalize, micro, depth int) (*Prefetcher, error) {
	switch {
	case d == nil || d.SampleSize() < 1:
		return nil, errors.New("data: prefetch: needs a dataset with samples of positive size")
	case micro < 1:
		return nil, fmt.Errorf("data: prefetch: micro-batch must be >= 1, got %d", micro)
	case depth < 0 || depth > MaxPrefetch:
		return nil, fmt.Errorf("data: prefetch: depth must be in [0, %d], got %d", MaxPrefetch, depth)
	}
	if err := norm.Validate(); err != nil {
		return nil, fmt.Errorf("data: prefetch: normalize.%w", err)
	}
	p := &Prefetcher{d: d, norm: norm, depth: depth, micro: micro, err: ErrSequenceDone}
	if depth == 0 {
		p.only = NewBatch(micro, d.SampleSize())
		return p, nil
	}
	p.free = make(chan *Batch, depth+1)
	// Every item in ready carries one of the depth+1 batches, so sending never blocks.
	p.ready = make(chan filled, depth+1)
	for range depth + 1 {
		p.free <- NewBatch(micro, d.SampleSize())
	}
	return p, nil
}

// MicroBatch is the capacity of the batches, the micro-batch size the prefetcher was made for.
func (p *Prefetcher) MicroBatch() int { return p.micro }

// Depth is the number of micro-batches filled ahead (0: filled synchronously in Next).
func (p *Prefetcher) Depth() int { return p.depth }

// Start stops the sequence in flight, if any (its unconsumed batches are dropped), and begins
// filling seq. Its batches come from Next in order.
func (p *Prefetcher) Start(seq Sequence) error {
	if p.closed {
		return ErrPrefetcherClosed
	}
	if seq.Len < 0 || (seq.Len > 0 && seq.Indices == nil) {
		return fmt.Errorf("data: prefetch: invalid sequence of %d micro-batches", seq.Len)
	}
	p.Stop()
	p.seq, p.k, p.err = seq, 0, nil
	if p.depth > 0 && seq.Len > 0 {
		p.stop = make(chan struct{})
		p.wg.Add(1)
		go p.produce(seq, p.stop)
	}
	return nil
}

// produce fills the sequence's micro-batches in order, as free batches allow, and stops at
// the first error (after handing it on) or when stop is closed.
func (p *Prefetcher) produce(seq Sequence, stop <-chan struct{}) {
	defer p.wg.Done()
	for k := range seq.Len {
		var b *Batch
		select {
		case b = <-p.free:
		case <-stop:
			return
		}
		err := p.fill(b, seq, k)
		if err != nil {
			err = fmt.Errorf("micro-batch %d of the sequence: %w", k, err)
		}
		p.ready <- filled{b: b, err: err}
		if err != nil {
			return
		}
	}
}

// fill fills micro-batch k of seq into b.
func (p *Prefetcher) fill(b *Batch, seq Sequence, k int) error {
	if seq.Draw != nil {
		return p.d.FillAugmented(b, seq.Indices(k), p.norm, *seq.Draw)
	}
	return p.d.Fill(b, seq.Indices(k), p.norm)
}

// Next returns the next micro-batch of the sequence. The batch stays valid, and unchanged,
// until the next call to Next, Start, Stop or Close; the consumer must not write to it. After
// the last micro-batch Next returns ErrSequenceDone; after an error from Fill it returns that
// error (wrapped) and the sequence is over. It waits for the producer, or for ctx.
func (p *Prefetcher) Next(ctx context.Context) (*Batch, error) {
	if p.closed {
		return nil, ErrPrefetcherClosed
	}
	p.release()
	if p.err != nil {
		return nil, p.err
	}
	if p.k >= p.seq.Len {
		p.err = ErrSequenceDone
		return nil, p.err
	}
	if p.depth == 0 {
		k := p.k
		if err := p.fill(p.only, p.seq, k); err != nil {
			p.err = fmt.Errorf("data: prefetch: micro-batch %d of the sequence: %w", k, err)
			return nil, p.err
		}
		p.k++
		return p.only, nil
	}
	var f filled
	// A batch that is ready is taken even when ctx is done, so the outcome does not depend
	// on which of the two select picks.
	select {
	case f = <-p.ready:
	default:
		select {
		case f = <-p.ready:
		case <-ctx.Done():
			return nil, fmt.Errorf("data: prefetch: waiting for micro-batch %d: %w", p.k, context.Cause(ctx))
		}
	}
	p.k++
	p.held = f.b
	if f.err != nil {
		p.err = fmt.Errorf("data: prefetch: %w", f.err)
		return nil, p.err
	}
	return f.b, nil
}

// release gives the batch the consumer held back to the producer.
func (p *Prefetcher) release() {
	if p.held != nil {
		p.free <- p.held // cannot block: free has room for every batch
		p.held = nil
	}
}

// Stop ends the sequence in flight and waits for the producer to exit; the batches return to
// the ring. Next then returns ErrSequenceDone until the next Start. Safe to call at any time.
func (p *Prefetcher) Stop() {
	if p.stop != nil {
		close(p.stop)
		p.wg.Wait()
		p.stop = nil
	}
	if p.depth > 0 {
		for len(p.ready) > 0 {
			p.free <- (<-p.ready).b
		}
		p.release()
	}
	p.seq, p.k, p.err = Sequence{}, 0, ErrSequenceDone
}

// Close stops the producer and waits for it; the prefetcher cannot be used afterwards. Safe
// to call twice.
func (p *Prefetcher) Close() error {
	if !p.closed {
		p.Stop()
		p.closed = true
	}
	return nil
}
