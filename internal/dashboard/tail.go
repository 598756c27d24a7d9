package dashboard

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sync"

	"github.com/qvd/qvd/internal/metrics"
)

// Tail reads a metrics file incrementally: Poll reads what was appended since the last Poll
// and parses its complete lines. The records stay in memory, in file order.
type Tail struct {
	path string

	mu struct {
		sync.Mutex
		recs      []metrics.Record
		offset    int64 // bytes of the file consumed: always just past a newline
		malformed int   // complete lines that did not parse
		gen       int   // incremented whenever the file shrank and the Tail started over
	}
}

// NewTail returns a Tail of the metrics file at path; the file need not exist yet.
func NewTail(path string) *Tail { return &Tail{path: path} }

// Snapshot is what a Poll saw: the records with index >= since and the counters.
type Snapshot struct {
	Records   []metrics.Record
	Total     int // records held; the next poll's since
	Malformed int
	Gen       int
}

// Poll reads what was appended to the file since the last Poll and returns the records from
// index since on, at most limit of them (limit <= 0: all). A missing file gives no records
// and no error.
func (t *Tail) Poll(since, limit int) (Snapshot, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if err := t.readLocked(); err != nil {
		return Snapshot{}, err
	}
	if since < 0 {
		since = 0
	}
	s := Snapshot{Total: len(t.mu.recs), Malformed: t.mu.malformed, Gen: t.mu.gen}
	if since < len(t.mu.recs) {
		// A copy: the caller encodes it after the lock is released while appends go on.
		recs := t.mu.recs[since:]
		if limit > 0 && len(recs) > limit {
			recs = recs[:limit]
		}
		s.Records = append([]metrics.Record(nil), recs...)
	}
	return s, nil
}

func (t *Tail) readLocked() error {
	f, err := os.Open(t.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("opening metrics file: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("metrics file %s: %w", t.path, err)
	}
	if st.Size() < t.mu.offset {
		// Replaced or truncated: a new run in the same directory. Start over.
		t.mu.recs, t.mu.offset, t.mu.malformed = nil, 0, 0
		t.mu.gen++
	}
	if _, err := f.Seek(t.mu.offset, io.SeekStart); err != nil {
		return fmt.Errorf("metrics file %s: %w", t.path, err)
	}
	// Reading again from offset, rather than keeping the unfinished line's bytes, sees a writer
	// that rewrites the tail (metrics.Create trims a torn line before appending).
	buf, err := io.ReadAll(f)
	if err != nil {
		return fmt.Errorf("reading metrics file %s: %w", t.path, err)
	}
	end := bytes.LastIndexByte(buf, '\n') + 1 // 0: no complete line yet
	for rest := buf[:end]; len(rest) > 0; {
		i := bytes.IndexByte(rest, '\n')
		line := bytes.TrimSpace(rest[:i])
		rest = rest[i+1:]
		if len(line) == 0 {
			continue
		}
		var r metrics.Record
		if err := json.Unmarshal(line, &r); err != nil {
			t.mu.malformed++
			continue
		}
		t.mu.recs = append(t.mu.recs, r)
	}
	t.mu.offset += int64(end)
	return nil
}
