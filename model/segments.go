package model

import "fmt"

// Segments splits spec's layers into k contiguous segments and returns the index of each
// segment's first layer (the first is 0). Segment boundaries fall at CutPoints (just before
// weight layers or residual branches, never inside a branch); among those splits it picks one
// minimising the largest segment's activation size (the sum of its layers' output elements
// per sample), which bounds the recomputed segment's share of peak memory.
func Segments(spec *Spec, k int) ([]int, error) {
	starts := CutPoints(spec)
	if k < 1 || k > len(starts) {
		return nil, fmt.Errorf("model: activation checkpointing: segments must be in [1, %d] (the places this model can be cut), got %d", len(starts), k)
	}
	cost := make([]int, len(starts))
	for u := range starts {
		end := len(spec.Layers)
		if u+1 < len(starts) {
			end = starts[u+1]
		}
		for _, l := range spec.Layers[starts[u]:end] {
			cost[u] += prod(l.OutShape)
		}
	}
	// best[j][u]: the smallest possible largest segment when units [0, u) form j segments.
	const inf = int(^uint(0) >> 1)
	nu := len(starts)
	best := make([][]int, k+1)
	cut := make([][]int, k+1)
	for j := range best {
		best[j] = make([]int, nu+1)
		cut[j] = make([]int, nu+1)
		for u := range best[j] {
			best[j][u] = inf
		}
	}
	best[0][0] = 0
	for j := 1; j <= k; j++ {
		for u := j; u <= nu; u++ {
			sum := 0
			for v := u - 1; v >= j-1; v-- { // the last segment is units [v, u)
				sum += cost[v]
				if best[j-1][v] == inf {
					continue
				}
				if m := max(best[j-1][v], sum); m < best[j][u] {
					best[j][u], cut[j][u] = m, v
				}
			}
		}
	}
	first := make([]int, k)
	for j, u := k, nu; j > 0; j-- {
		u = cut[j][u]
		first[j-1] = starts[u]
	}
	return first, nil
}
