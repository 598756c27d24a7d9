package sharded

import (
	"context"
	"errors"
	"fmt"

	"github.com/qvd/qvd/collective"
)

// restoreChunk bounds the buffer the optimizer state streams through on resume.
const restoreChunk = 1 << 22

// LoadState fills every rank's part of the optimizer state from rank 0's checkpoint. The
// flat space [0, n) is walked in chunks, buffer by buffer; rank 0 reads each chunk from src
// (whichever saved shards overlap it: the checkpoint may come from any world size and stage)
// and broadcasts it, and each rank copies the part inside its own range [lo, hi) into state,
// whose buffers hold that range. Rank 0's read status is agreed before each chunk travels, so
// a read error on rank 0 fails every rank at the same chunk instead of leaving them waiting.
// Every rank calls it with the same n and buffer names; src is used on rank 0 only.
func LoadState(ctx context.Context, comm Comm, src *Source, n, lo, hi int, state []Buffer) error {
	return loadState(ctx, comm, src, n, lo, hi, state, restoreChunk)
}

func loadState(ctx context.Context, comm Comm, src *Source, n, lo, hi int, state []Buffer, chunkElems int) error {
	g := group{comm}
	chunk := min(chunkElems, max(n, 1))
	buf := make([]float32, chunk)
	for _, nb := range state {
		for a := 0; a < n; a += chunk {
			b := min(a+chunk, n)
			part := buf[:b-a]
			var rerr error
			if g.rank() == 0 {
				rerr = src.Read(nb.Name, a, part)
			}
			// Rank 0's read status first, so that on a failed read no rank waits for the
			// chunk; rank 0's own flag is the only one that can be set.
			failed, err := g.anyFailed(ctx, rerr != nil)
			if err != nil {
				return errors.Join(rerr, fmt.Errorf("synchronising optimizer state %s from rank 0: %w", nb.Name, err))
			}
			if rerr != nil {
				return rerr
			}
			if failed {
				return fmt.Errorf("resume: rank 0 could not read optimizer state %s [%d, %d) from its checkpoint", nb.Name, a, b)
			}
			if !g.alone() {
				if err := comm.Broadcast(ctx, part, 0, collective.Call{}); err != nil {
					return fmt.Errorf("synchronising optimizer state %s from rank 0: %w", nb.Name, err)
				}
			}
			if x, y, ok := overlap(a, b, lo, hi); ok {
				copy(nb.Data[x-lo:y-lo], part[x-a:y-a])
			}
		}
	}
	return nil
}
