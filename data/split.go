package data

import (
	"fmt"
	"math"
	"slices"
)

// valDraw is the epoch argument of the Permutation that draws a validation split: training
// epochs are >= 0, so the held-out draw never coincides with an epoch's shuffle.
const valDraw = -1

// HoldOut splits d into the samples left for training and a validation split of
// floor(frac × d.N) samples drawn by seed alone: the same on every rank and after a resume,
// whatever the world size. Both keep d's sample order and share its storage (nothing is
// copied but the labels); the held-out samples are not in rest, so they are never trained
// on. An empty side is an error.
func HoldOut(d *Dataset, frac float64, seed uint64) (rest, val *Dataset, err error) {
	if !(frac > 0 && frac < 1) {
		return nil, nil, fmt.Errorf("the held-out fraction must be in (0, 1), got %g", frac)
	}
	nVal := int(math.Floor(frac * float64(d.N)))
	if nVal < 1 || nVal >= d.N {
		return nil, nil, fmt.Errorf("%g of the %d training samples is %d: need at least one sample on each side", frac, d.N, nVal)
	}
	perm := make([]int32, d.N)
	Permutation(perm, seed, valDraw)
	held := perm[:nVal]
	slices.Sort(held)
	kept := make([]int32, 0, d.N-nVal)
	next := 0
	for i := range int32(d.N) {
		if next < len(held) && held[next] == i {
			next++
			continue
		}
		kept = append(kept, i)
	}
	return d.view(kept), d.view(held), nil
}

// view is the samples idx of d (indices into d, in that order), sharing d's storage.
func (d *Dataset) view(idx []int32) *Dataset {
	v := *d
	v.N, v.stored = len(idx), d.storedN()
	v.rows = make([]int32, len(idx))
	v.Labels = make([]uint8, len(idx))
	for k, i := range idx {
		v.rows[k] = int32(d.row(int(i)))
		v.Labels[k] = d.Labels[i]
	}
	return &v
}
