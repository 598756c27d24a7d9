package offload

import (
	"sync"

	"github.com/qvd/qvd/internal/vec"
)

// Stream moves data between the device the model computes on and host memory, in the order
// the transfers were enqueued and concurrently with the caller — what a CUDA copy stream
// (cuMemcpyDtoHAsync / cuMemcpyHtoDAsync) does for the GPU engine. ZeRO-Offload uses it for the
// gradient shard (device → host, accumulated into the fp32 host shard while the next bucket is
// reduced) and for the updated parameters (host → device). Every method is called from the
// owner's goroutine; a Ticket says when one transfer has finished, so a staging buffer is
// reused only once the transfer reading it is done.
type Stream interface {
	// Copy enqueues dst = src.
	Copy(dst, src []float32) Ticket
	// Accumulate enqueues dst += src (a gradient moved to the host and summed into the
	// host copy in one pass).
	Accumulate(dst, src []float32) Ticket
	// Wait blocks until the transfer with ticket t (and everything before it) is done.
	Wait(t Ticket)
	// Sync blocks until every enqueued transfer is done.
	Sync()
	// Close waits for the queue to drain and stops the stream.
	Close() error
}

// Ticket identifies an enqueued transfer; later transfers have larger tickets.
type Ticket uint64

// HostStream is the CPU engine's Stream: device and host memory are the same RAM, so a
// transfer is a memory copy, run by one goroutine that owns the queue so it overlaps the
// caller's compute and communication just as a DMA engine would.
type HostStream struct {
	jobs chan streamJob
	mu   sync.Mutex
	cond *sync.Cond
	done Ticket // highest finished ticket
	next Ticket // highest enqueued ticket
	stop sync.WaitGroup
	once sync.Once
}

type streamJob struct {
	dst, src []float32
	add      bool
	t        Ticket
}

// NewHostStream starts a stream with a queue of depth transfers (enqueueing blocks beyond it).
func NewHostStream(depth int) *HostStream {
	s := &HostStream{jobs: make(chan streamJob, max(depth, 1))}
	s.cond = sync.NewCond(&s.mu)
	s.stop.Add(1)
	go s.run()
	return s
}

func (s *HostStream) run() {
	defer s.stop.Done()
	for j := range s.jobs {
		if j.add {
			vec.Add(j.dst, j.src)
		} else {
			copy(j.dst, j.src)
		}
		s.mu.Lock()
		s.done = j.t
		s.cond.Broadcast()
		s.mu.Unlock()
	}
}

func (s *HostStream) enqueue(dst, src []float32, add bool) Ticket {
	if len(dst) != len(src) {
		panic("offload: stream transfer between buffers of different lengths")
	}
	s.next++
	s.jobs <- streamJob{dst: dst, src: src, add: add, t: s.next}
	return s.next
}

// Copy enqueues dst = src.
func (s *HostStream) Copy(dst, src []float32) Ticket { return s.enqueue(dst, src, false) }

// Accumulate enqueues dst += src.
func (s *HostStream) Accumulate(dst, src []float32) Ticket { return s.enqueue(dst, src, true) }

// Wait blocks until ticket t is done.
func (s *HostStream) Wait(t Ticket) {
	s.mu.Lock()
	for s.done < t {
		s.cond.Wait()
	}
	s.mu.Unlock()
}

// Sync blocks until every enqueued transfer is done.
func (s *HostStream) Sync() { s.Wait(s.next) }

// Close drains the queue and stops the goroutine; safe to call twice.
func (s *HostStream) Close() error {
	s.once.Do(func() {
		close(s.jobs)
		s.stop.Wait()
	})
	return nil
}
