package grpcnet

import (
	"math/bits"
	"sync"

	"google.golang.org/grpc/mem"
)

// dirtyPool is the mem.BufferPool gRPC reads frames into and marshals into. gRPC's default
// pool zeroes every buffer it hands out, which cost about an eighth of the CPU of a stream
// (runtime.memclrNoHeapPointers under sizedBufferPool.Get); gRPC fills every byte of a buffer
// it asks for (a frame is read with io.ReadFull into exactly its length), so stale contents
// are never exposed and the zeroing buys nothing. Buffers are pooled in power-of-two tiers
// from 4 KiB (below, gRPC does not pool) to 1 MiB (above, messages are split into 16 KiB
// HTTP/2 frames anyway).
type dirtyPool struct {
	tiers [maxTierShift - minTierShift + 1]sync.Pool
}

const (
	minTierShift = 12 // 4 KiB
	maxTierShift = 20 // 1 MiB
)

var framePool = new(dirtyPool)

var _ mem.BufferPool = (*dirtyPool)(nil)

// tier returns the index of the smallest tier holding n bytes, or -1 if none does.
func tier(n int) int {
	if n > 1<<maxTierShift {
		return -1
	}
	shift := minTierShift
	if n > 1<<minTierShift {
		shift = bits.Len(uint(n - 1))
	}
	return shift - minTierShift
}

func (p *dirtyPool) Get(n int) *[]byte {
	i := tier(n)
	if i < 0 {
		b := make([]byte, n)
		return &b
	}
	if v := p.tiers[i].Get(); v != nil {
		b := v.(*[]byte)
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<(i+minTierShift))
	return &b
}

func (p *dirtyPool) Put(b *[]byte) {
	c := cap(*b)
	if c < 1<<minTierShift || c > 1<<maxTierShift || c&(c-1) != 0 {
		return // not one of ours
	}
	p.tiers[bits.Len(uint(c))-1-minTierShift].Put(b)
}
