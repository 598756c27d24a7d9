package trainer

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/optim"
)

// ErrNoSnapshot is Assemble's error when the neighbour snapshots the group holds do not cover
// every shard at any one step (two ring neighbours died together, or no snapshot had been
// completed yet): the caller falls back to the newest checkpoint. It comes wrapped in a
// *MissingShardsError.
var ErrNoSnapshot = errors.New("trainer: the neighbour snapshots do not cover every shard")

// MissingShardsError names the shards (by rank in the old world) that no survivor holds at
// Step, the newest step any survivor has a snapshot of (-1: none).
type MissingShardsError struct {
	Step    int64
	Missing []int
}

func (e *MissingShardsError) Error() string {
	if e.Step < 0 {
		return ErrNoSnapshot.Error() + ": no survivor holds a completed snapshot"
	}
	return fmt.Sprintf("%v: at step %d no survivor holds the shards of old ranks %v (neither their own snapshot nor their successor's copy)",
		ErrNoSnapshot, e.Step, e.Missing)
}

func (e *MissingShardsError) Unwrap() error { return ErrNoSnapshot }

// holding is what one survivor holds, as planAssembly sees it.
type holding struct {
	rank      int     // in the new group
	oldRank   int     // in the old one
	own, peer []int64 // steps of its complete own snapshots and copies of oldRank-1's shard
}

// source is where one old shard comes from: the new rank holding it, and whether as a peer
// copy (else its owner's own snapshot).
type source struct {
	rank int
	peer bool
}

// planAssembly chooses the newest step S at which every shard of the old world of oldWorld
// ranks is held — by its owner's own snapshot, else by its successor's copy — and where each
// shard comes from; meta is the new rank whose own snapshot at S gives the position and the
// frozen weights (the lowest that has one). The owner's snapshot is preferred: it needs no
// neighbour. Otherwise the error is a *MissingShardsError.
func planAssembly(oldWorld int, hs []holding) (step int64, src []source, meta int, err error) {
	byOld := make([]*holding, oldWorld)
	for i := range hs {
		h := &hs[i]
		if h.oldRank < 0 || h.oldRank >= oldWorld {
			return 0, nil, 0, fmt.Errorf("trainer: assembling the state: new rank %d held old rank %d, outside the old world of %d", h.rank, h.oldRank, oldWorld)
		}
		if byOld[h.oldRank] != nil {
			return 0, nil, 0, fmt.Errorf("trainer: assembling the state: new ranks %d and %d both held old rank %d", byOld[h.oldRank].rank, h.rank, h.oldRank)
		}
		byOld[h.oldRank] = h
	}
	var steps []int64
	for _, h := range hs {
		steps = append(steps, h.own...)
	}
	slices.Sort(steps)
	steps = slices.Compact(steps)
	slices.Reverse(steps)
	var first *MissingShardsError
	for _, s := range steps {
		src = make([]source, oldWorld)
		var missing []int
		for q := range oldWorld {
			if h := byOld[q]; h != nil && slices.Contains(h.own, s) {
				src[q] = source{rank: h.rank}
			} else if h := byOld[(q+1)%oldWorld]; h != nil && slices.Contains(h.peer, s) {
				src[q] = source{rank: h.rank, peer: true}
			} else {
				missing = append(missing, q)
			}
		}
		if missing == nil {
			meta = math.MaxInt
			for _, h := range hs {
				if slices.Contains(h.own, s) {
					meta = min(meta, h.rank)
				}
			}
			return s, src, meta, nil
		}
		if first == nil {
			first = &MissingShardsError{Step: s, Missing: missing}
		}
	}
	if first == nil {
		first = &MissingShardsError{Step: -1}
	}
	return 0, nil, 0, first
}

// assembleInfo is the description of the state that the meta rank sends the others.
type assembleInfo struct {
	Size, Frozen int
	Names        []string
	Shards       collective.Shards
	Position     SnapshotPosition
}

// infoLen is the int64s each rank contributes to Assemble's first exchange: whether it holds
// a snapshot, its old rank and world, the steps of two own snapshots and two peer copies, and
// the weights' length.
const infoLen = 8

// Assemble rebuilds the whole training state from the neighbour snapshots that the members of
// a new group hold, over the new group's communicator: every member calls it, a survivor with
// its old trainer's Snapshot, a newcomer with nil. The members agree on the newest step at
// which every shard of the old world is held (planAssembly), and each piece is broadcast
// from the member that has it, so every member returns the same State, bit for bit the one
// the old group had at that step: the weights whole (frozen prefix included), every optimizer
// buffer whole, the optimizer's step count, the scaler and the training position. From it
// Setup.State builds the next trainer at any world and stage. When two ring neighbours died
// together the error wraps ErrNoSnapshot, and the caller falls back to a checkpoint.
func Assemble(ctx context.Context, comm collective.Communicator, snap *Snapshot) (*State, error) {
	world, me := comm.Size(), comm.Rank()
	info := make([]int64, world*infoLen)
	for i := range info {
		info[i] = math.MinInt64
	}
	mine := info[me*infoLen : (me+1)*infoLen]
	if snap == nil {
		mine[0] = 0
	} else {
		steps := func(n int, step func(int) int64) [2]int64 {
			s := [2]int64{-1, -1}
			for i := range min(n, 2) {
				s[i] = step(i)
			}
			return s
		}
		own := steps(len(snap.Own), func(i int) int64 { return snap.Own[i].Step })
		peer := steps(len(snap.Peer), func(i int) int64 { return snap.Peer[i].Step })
		copy(mine, []int64{1, int64(snap.Rank), int64(snap.World), own[0], own[1], peer[0], peer[1], int64(snap.Size)})
	}
	if world > 1 {
		if err := comm.AllReduceInt64(ctx, info, collective.Max); err != nil {
			return nil, fmt.Errorf("trainer: assembling the state: %w", err)
		}
	}
	var hs []holding
	oldWorld, size := -1, -1
	for r := range world {
		v := info[r*infoLen : (r+1)*infoLen]
		if v[0] != 1 {
			continue
		}
		if oldWorld >= 0 && (v[2] != int64(oldWorld) || v[7] != int64(size)) {
			return nil, fmt.Errorf("trainer: assembling the state: rank %d's snapshots are of a world of %d and %d weights, another's of %d and %d",
				r, v[2], v[7], oldWorld, size)
		}
		oldWorld, size = int(v[2]), int(v[7])
		h := holding{rank: r, oldRank: int(v[1])}
		for _, s := range v[3:5] {
			if s >= 0 {
				h.own = append(h.own, s)
			}
		}
		for _, s := range v[5:7] {
			if s >= 0 {
				h.peer = append(h.peer, s)
			}
		}
		hs = append(hs, h)
	}
	if len(hs) == 0 {
		return nil, &MissingShardsError{Step: -1}
	}
	step, src, meta, err := planAssembly(oldWorld, hs)
	if err != nil {
		return nil, err
	}

	// The meta rank describes the state: the layout and the position at step.
	var desc assembleInfo
	var frozen []float32
	if me == meta {
		o := ownAt(snap, step)
		frozen = o.Frozen
		desc = assembleInfo{Size: snap.Size, Frozen: snap.Frozen, Names: snap.Names, Shards: snap.Shards, Position: o.Position}
	}
	if err := broadcastJSON(ctx, comm, meta, &desc); err != nil {
		return nil, fmt.Errorf("trainer: assembling the state: %w", err)
	}
	if err := desc.Shards.Validate(desc.Size-desc.Frozen, oldWorld); err != nil {
		return nil, fmt.Errorf("trainer: assembling the state: the snapshots' shards: %w", err)
	}
	trainable := desc.Size - desc.Frozen
	s := &State{
		Master:         make([]float32, desc.Size),
		OptimizerSteps: desc.Position.OptimizerSteps,
		Step:           desc.Position.Step, Epoch: desc.Position.Epoch, Offset: desc.Position.Offset, Skipped: desc.Position.Skipped,
		Scaler: desc.Position.Scaler,
	}
	for _, name := range desc.Names {
		s.Optimizer = append(s.Optimizer, optim.NamedBuffer{Name: name, Data: make([]float32, trainable)})
	}
	if desc.Frozen > 0 {
		if me == meta {
			copy(s.Master[:desc.Frozen], frozen)
		}
		if err := broadcast(ctx, comm, s.Master[:desc.Frozen], meta); err != nil {
			return nil, fmt.Errorf("trainer: assembling the state: the frozen weights: %w", err)
		}
	}

	// Each old shard, master and optimizer buffers in one piece, from the member that holds it.
	nb := len(desc.Names)
	longest := 0
	for q := range oldWorld {
		longest = max(longest, desc.Shards[q+1]-desc.Shards[q])
	}
	scratch := make([]float32, (1+nb)*longest)
	for q := range oldWorld {
		lo, hi := desc.Shards[q], desc.Shards[q+1]
		n := hi - lo
		piece := scratch[:(1+nb)*n]
		if me == src[q].rank {
			c, err := shardAt(snap, q, step, src[q].peer)
			if err != nil {
				return nil, err
			}
			if len(c.Master) != n || len(c.Optimizer) != nb {
				return nil, fmt.Errorf("trainer: assembling the state: the snapshot of old rank %d's shard holds %d weights and %d buffers, want %d and %d",
					q, len(c.Master), len(c.Optimizer), n, nb)
			}
			copy(piece, c.Master)
			for b, d := range c.Optimizer {
				copy(piece[(1+b)*n:(2+b)*n], d)
			}
		}
		if err := broadcast(ctx, comm, piece, src[q].rank); err != nil {
			return nil, fmt.Errorf("trainer: assembling the state: old rank %d's shard: %w", q, err)
		}
		copy(s.Master[desc.Frozen+lo:desc.Frozen+hi], piece[:n])
		for b := range nb {
			copy(s.Optimizer[b].Data[lo:hi], piece[(1+b)*n:(2+b)*n])
		}
	}
	return s, nil
}

// ownAt is snap's own snapshot at step (planAssembly chose a rank that has one).
func ownAt(snap *Snapshot, step int64) *OwnCopy {
	for i := range snap.Own {
		if snap.Own[i].Step == step {
			return &snap.Own[i]
		}
	}
	panic(fmt.Sprintf("trainer: no own snapshot at step %d", step))
}

// shardAt is old rank q's shard at step from snap: its own snapshot, or its peer copy.
func shardAt(snap *Snapshot, q int, step int64, peer bool) (ShardCopy, error) {
	list := snap.Peer
	if !peer {
		list = nil
		for _, o := range snap.Own {
			list = append(list, o.ShardCopy)
		}
	}
	for _, c := range list {
		if c.Step == step && c.Rank == q {
			return c, nil
		}
	}
	return ShardCopy{}, fmt.Errorf("trainer: assembling the state: this rank holds no copy of old rank %d's shard at step %d", q, step)
}

func broadcast(ctx context.Context, comm collective.Communicator, buf []float32, root int) error {
	if comm.Size() == 1 {
		return nil
	}
	return comm.Broadcast(ctx, buf, root, collective.Call{})
}

// broadcastJSON sends root's v to every rank: its length first, then the bytes.
func broadcastJSON(ctx context.Context, comm collective.Communicator, root int, v any) error {
	if comm.Size() == 1 {
		return nil
	}
	var b []byte
	n := []int64{0}
	if comm.Rank() == root {
		var err error
		if b, err = json.Marshal(v); err != nil {
			return err
		}
		n[0] = int64(len(b))
	}
	if err := comm.AllReduceInt64(ctx, n, collective.Max); err != nil {
		return err
	}
	if comm.Rank() != root {
		b = make([]byte, n[0])
	}
	if err := comm.BroadcastBytes(ctx, b, root); err != nil {
		return err
	}
	if comm.Rank() == root {
		return nil
	}
	return json.Unmarshal(b, v)
}
