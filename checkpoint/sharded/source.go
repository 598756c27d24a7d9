package sharded

import (
	"fmt"
	"slices"

	"github.com/qvd/qvd/checkpoint"
)

// Files is what a Source reads from: an open checkpoint (*checkpoint.Checkpoint).
type Files interface {
	// FilePath fails for a file the checkpoint does not list.
	FilePath(name string) (string, error)
	Safetensors(name string) (*checkpoint.File, error)
}

var _ Files = (*checkpoint.Checkpoint)(nil)

// Source reads optimizer state out of a checkpoint's shards by flat range, whatever world
// size and stage wrote them. It holds one decoded shard tensor at a time: a restore walks
// the flat space in order, so each is decoded once per state buffer. Not safe for
// concurrent use.
type Source struct {
	files  Files
	shards []ShardMeta // sorted by offset, tiling [0, size)
	cached struct {
		file, name string
		data       []float32
	}
}

// NewSource checks that shards (meta.json's opt_shards) tile the size-element flat space
// exactly and are all present in files.
func NewSource(files Files, shards []ShardMeta, size int) (*Source, error) {
	s := &Source{files: files, shards: slices.Clone(shards)}
	slices.SortFunc(s.shards, func(a, b ShardMeta) int { return a.Offset - b.Offset })
	at := 0
	for _, sh := range s.shards {
		if sh.Offset != at || sh.Length < 0 {
			return nil, fmt.Errorf("meta.json: optimizer shards do not tile the %d-element flat space (shard %s covers [%d, %d), expected to start at %d)",
				size, sh.File, sh.Offset, sh.Offset+sh.Length, at)
		}
		if _, err := files.FilePath(sh.File); err != nil {
			return nil, fmt.Errorf("optimizer shard %s [%d, %d) is missing: %w", sh.File, sh.Offset, sh.Offset+sh.Length, err)
		}
		at += sh.Length
	}
	if at != size {
		return nil, fmt.Errorf("meta.json: optimizer shards cover [0, %d) of a %d-element flat space", at, size)
	}
	return s, nil
}

// Read fills dst with state buffer name over [lo, lo+len(dst)).
func (s *Source) Read(name string, lo int, dst []float32) error {
	hi := lo + len(dst)
	for _, sh := range s.shards {
		a, b, ok := overlap(lo, hi, sh.Offset, sh.Offset+sh.Length)
		if !ok {
			continue
		}
		if s.cached.file != sh.File || s.cached.name != name {
			s.cached.data = nil // let the previous one go before decoding the next
			f, err := s.files.Safetensors(sh.File)
			if err != nil {
				return fmt.Errorf("optimizer shard %s: %w", sh.File, err)
			}
			data := make([]float32, sh.Length)
			if err := f.ReadInto(name, data, []int{sh.Length}); err != nil {
				return fmt.Errorf("optimizer shard %s: state %q: %w", sh.File, name, err)
			}
			s.cached.file, s.cached.name, s.cached.data = sh.File, name, data
		}
		copy(dst[a-lo:b-lo], s.cached.data[a-sh.Offset:b-sh.Offset])
	}
	return nil
}

// overlap is the intersection of [aLo, aHi) and [bLo, bHi), if not empty.
func overlap(aLo, aHi, bLo, bHi int) (lo, hi int, ok bool) {
	lo, hi = max(aLo, bLo), min(aHi, bHi)
	return lo, hi, lo < hi
}
