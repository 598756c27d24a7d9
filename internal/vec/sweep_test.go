package vec

import (
	"flag"
	"fmt"
	"math"
	"runtime"
	"sync"
	"testing"

	"github.com/qvd/qvd/internal/half"
)

var sweep = flag.Bool("vec.sweep", false, "run TestEncodeSweep over all 2^32 float32 words (20 to 45 s on two cores)")

// TestEncodeSweep compares EncodeF16 and EncodeBF16 with internal/half's scalar conversions on
// every float32 word, with the implementation this build selects (run it again with
// -tags purego for the Go loops). It is too slow for every run, so it needs -vec.sweep:
//
//	go test -run EncodeSweep -vec.sweep ./internal/vec/
func TestEncodeSweep(t *testing.T) {
	if !*sweep {
		t.Skip("pass -vec.sweep to convert all 2^32 float32 words")
	}
	t.Logf("kernels: %s", Accelerated())
	const chunk = 1 << 20
	const chunks = 1 << 32 / chunk
	workers := runtime.GOMAXPROCS(0)
	next := make(chan uint32, workers)
	var wg sync.WaitGroup
	var mu sync.Mutex
	var failures []string
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src := make([]float32, chunk)
			f16, bf16 := make([]uint16, chunk), make([]uint16, chunk)
			for c := range next {
				base := c * chunk
				for i := range src {
					src[i] = math.Float32frombits(base + uint32(i))
				}
				EncodeF16(f16, src)
				EncodeBF16(bf16, src)
				for i, v := range src {
					if f16[i] != half.F32ToF16(v) || bf16[i] != half.F32ToBF16(v) {
						mu.Lock()
						failures = append(failures, fmt.Sprintf("%#08x: fp16 %#04x want %#04x, bf16 %#04x want %#04x",
							base+uint32(i), f16[i], half.F32ToF16(v), bf16[i], half.F32ToBF16(v)))
						mu.Unlock()
						break
					}
				}
			}
		}()
	}
	for c := range uint32(chunks) {
		next <- c
	}
	close(next)
	wg.Wait()
	for _, f := range failures {
		t.Error(f)
	}
	if len(failures) == 0 {
		t.Logf("all %d float32 words encode identically to half.F32ToF16 and half.F32ToBF16", uint64(1)<<32)
	}
}
