package trainer

import (
	"errors"
	"reflect"
	"testing"
)

// TestPlanAssembly: the newest step at which every old shard is held, and where from.
func TestPlanAssembly(t *testing.T) {
	own := func(s ...int64) []int64 { return s }
	for _, c := range []struct {
		name     string
		oldWorld int
		hs       []holding
		step     int64
		src      []source
		meta     int
		missing  []int // a *MissingShardsError with these (nil: success)
		errStep  int64
		otherErr bool
	}{
		{
			name: "rank 2 of 4 lost: its successor's copy", oldWorld: 4,
			hs: []holding{
				{rank: 0, oldRank: 0, own: own(10, 9), peer: own(10, 9)},
				{rank: 1, oldRank: 1, own: own(10, 9), peer: own(10, 9)},
				{rank: 2, oldRank: 3, own: own(10, 9), peer: own(10, 9)},
			},
			step: 10, src: []source{{0, false}, {1, false}, {2, true}, {2, false}}, meta: 0,
		},
		{
			// The lost rank died while shipping snapshot 10: the copy of 9 is still whole, and
			// the survivors keep their own 9 until their commit of 10.
			name: "ship cut off: the previous step", oldWorld: 4,
			hs: []holding{
				{rank: 0, oldRank: 0, own: own(10, 9), peer: own(9)},
				{rank: 1, oldRank: 1, own: own(10, 9), peer: own(10, 9)},
				{rank: 2, oldRank: 3, own: own(10, 9), peer: own(9)},
			},
			step: 9, src: []source{{0, false}, {1, false}, {2, true}, {2, false}}, meta: 0,
		},
		{
			name: "survivors a snapshot apart", oldWorld: 3,
			hs: []holding{
				{rank: 0, oldRank: 1, own: own(12, 10), peer: own(12, 10)},
				{rank: 1, oldRank: 2, own: own(10, 8), peer: own(10, 8)},
			},
			step: 10, src: []source{{0, true}, {0, false}, {1, false}}, meta: 0,
		},
		{
			name: "two non-adjacent ranks of 4 lost", oldWorld: 4,
			hs: []holding{
				{rank: 0, oldRank: 0, own: own(5, 4), peer: own(5, 4)},
				{rank: 1, oldRank: 2, own: own(5, 4), peer: own(5, 4)},
			},
			step: 5, src: []source{{0, false}, {1, true}, {1, false}, {0, true}}, meta: 0,
		},
		{
			name: "a newcomer holds nothing; old rank 0 is new rank 2", oldWorld: 2,
			hs: []holding{
				{rank: 2, oldRank: 0, own: own(7, 6), peer: own(7, 6)},
			},
			step: 7, src: []source{{2, false}, {2, true}}, meta: 2,
		},
		{
			// Rank 0 lacks its own 6, its successor has a copy: 6, described by rank 1.
			name: "the meta rank is the lowest with its own snapshot at the step", oldWorld: 3,
			hs: []holding{
				{rank: 0, oldRank: 0, own: own(4), peer: own(6, 4)},
				{rank: 1, oldRank: 1, own: own(6, 4), peer: own(6, 4)},
				{rank: 2, oldRank: 2, own: own(6, 4), peer: own(6, 4)},
			},
			step: 6, src: []source{{1, true}, {1, false}, {2, false}}, meta: 1,
		},
		{
			name: "two adjacent ranks of 4 lost", oldWorld: 4,
			hs: []holding{
				{rank: 0, oldRank: 0, own: own(10, 9), peer: own(10, 9)},
				{rank: 1, oldRank: 1, own: own(10, 9), peer: own(10, 9)},
			},
			missing: []int{2}, errStep: 10,
		},
		{
			name: "the only copy of a lost shard is of a step the others no longer hold", oldWorld: 3,
			hs: []holding{
				{rank: 0, oldRank: 0, own: own(12, 11), peer: own(12, 11)},
				{rank: 1, oldRank: 2, own: own(12, 11), peer: own(10)},
			},
			missing: []int{1}, errStep: 12,
		},
		{
			name: "no snapshot completed yet", oldWorld: 3,
			hs:      []holding{{rank: 0, oldRank: 0}, {rank: 1, oldRank: 1}},
			missing: nil, errStep: -1,
		},
		{
			name: "two members claim one old rank", oldWorld: 3,
			hs:       []holding{{rank: 0, oldRank: 1, own: own(1)}, {rank: 1, oldRank: 1, own: own(1)}},
			otherErr: true,
		},
		{
			name: "an old rank outside the old world", oldWorld: 3,
			hs:       []holding{{rank: 0, oldRank: 3, own: own(1)}},
			otherErr: true,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			step, src, meta, err := planAssembly(c.oldWorld, c.hs)
			var me *MissingShardsError
			switch {
			case c.otherErr:
				if err == nil || errors.Is(err, ErrNoSnapshot) {
					t.Fatalf("want an error that is not ErrNoSnapshot, got %v", err)
				}
			case c.missing != nil || c.errStep == -1:
				if !errors.As(err, &me) || !errors.Is(err, ErrNoSnapshot) {
					t.Fatalf("want a *MissingShardsError, got step %d %v %v", step, src, err)
				}
				if me.Step != c.errStep || !reflect.DeepEqual(me.Missing, c.missing) {
					t.Fatalf("missing %v at step %d, want %v at %d (%v)", me.Missing, me.Step, c.missing, c.errStep, err)
				}
			case err != nil:
				t.Fatal(err)
			case step != c.step || !reflect.DeepEqual(src, c.src) || meta != c.meta:
				t.Fatalf("step %d from %v (meta %d), want step %d from %v (meta %d)", step, src, meta, c.step, c.src, c.meta)
			}
		})
	}
}
