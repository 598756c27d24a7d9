//go:build linux

package shmnet

import (
	"sync/atomic"
)

// ring is one directed pair's single-producer/single-consumer byte ring in the receiver's
// segment. head and tail count bytes since the start and never wrap (2^64 bytes is out of
// reach); a position's place in buf is pos & mask.
//
// Records. A frame is a 64-byte record header (the collective.Header in its first 40
// bytes) at a 64-byte aligned position, followed by its payload; the next record starts at
// the payload's end rounded up to 64. So headers never wrap round the end of buf and
// payloads start on a cache line. The sender publishes head as it copies (every
// publishBytes), so the receiver copies the start of a frame out while the rest goes in,
// and a frame larger than the ring streams through it.
type ring struct {
	head, tail  *atomic.Uint64
	data, space waitWord // the receiver sleeps on data, the sender on space
	attached    *atomic.Uint32
	prodState   *atomic.Uint32
	ctl         []byte // the slot's control page
	buf         []byte
	mask        uint64
}

// waitWord is one side's sleep: the futex word the other side bumps, the flag saying a
// sleeper is there (so the other side makes the wake system call only then), and the
// counter value the sleeper needs (so it is woken once, not for every byte).
type waitWord struct {
	seq     *atomic.Uint32
	waiting *atomic.Uint32
	want    *atomic.Uint64
}

const (
	recordAlign  = 64 // records start on a cache line
	recordHeader = 64 // bytes of a record before its payload
	// publishBytes is how much the sender copies between publishing head (and the receiver
	// between publishing tail): small enough that the other side starts early, large enough
	// that the atomics and wake checks cost nothing next to the copy.
	publishBytes = 64 << 10
)

func align(x uint64) uint64 { return (x + recordAlign - 1) &^ (recordAlign - 1) }

func (r *ring) size() uint64 { return r.mask + 1 }

// step is the most that one side moves its counter before publishing.
func (r *ring) step() uint64 { return min(publishBytes, r.size()/4) }

// signal wakes the sleeper on w if it waits for a value the counter has now reached. The
// sleeper stores want, then waiting, then reads the counter; this side stores the counter,
// then reads waiting and want. Go's atomics are sequentially consistent, so either the
// sleeper sees the new counter or this side sees it waiting.
func signal(w *waitWord, now uint64) {
	if w.waiting.Load() != 0 && now >= w.want.Load() {
		w.seq.Add(1)
		futexWake(w.seq)
	}
}

// put copies p into the ring at position pos (it may wrap once).
func (r *ring) put(pos uint64, p []byte) {
	i := pos & r.mask
	n := copy(r.buf[i:], p)
	if n < len(p) {
		copy(r.buf, p[n:])
	}
}

// get copies len(p) bytes from position pos.
func (r *ring) get(p []byte, pos uint64) {
	i := pos & r.mask
	n := copy(p, r.buf[i:])
	if n < len(p) {
		copy(p[n:], r.buf)
	}
}

// publishHead makes the sender's bytes up to h visible and wakes the receiver if it waits.
func (r *ring) publishHead(h uint64) {
	r.head.Store(h)
	signal(&r.data, h)
}

// publishTail frees the receiver's bytes up to t and wakes the sender if it waits.
func (r *ring) publishTail(t uint64) {
	r.tail.Store(t)
	signal(&r.space, t)
}

// wakeAll bumps both futex words and wakes whoever sleeps there, whatever they wait for:
// Close's way to make the sleepers look at the flags.
func (r *ring) wakeAll() {
	r.data.seq.Add(1)
	futexWake(r.data.seq)
	r.space.seq.Add(1)
	futexWake(r.space.seq)
}
