package metrics

import (
	"bufio"
	"bytes"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"strings"
)

// ReadFile reads every record of a metrics file in file order. A last line without a newline
// that does not parse is the record a killed run was writing and is dropped; a malformed line
// anywhere else is an error naming the file and the line number. Blank lines are skipped.
func ReadFile(path string) ([]Record, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading metrics file: %w", err)
	}
	defer f.Close()
	recs, err := read(f)
	if err != nil {
		return nil, fmt.Errorf("reading metrics file %s: %w", path, err)
	}
	return recs, nil
}

func read(r io.Reader) ([]Record, error) {
	// bufio.Reader rather than Scanner: a Scanner fails on lines longer than its buffer, and
	// one odd line must not make a long run's file unreadable.
	br := bufio.NewReaderSize(r, 64<<10)
	var recs []Record
	for lineNo := 1; ; lineNo++ {
		line, err := br.ReadBytes('\n')
		if err != nil && !errors.Is(err, io.EOF) {
			return recs, fmt.Errorf("line %d: %w", lineNo, err)
		}
		atEOF := err != nil
		complete := len(line) > 0 && line[len(line)-1] == '\n'
		if trimmed := bytes.TrimSpace(line); len(trimmed) > 0 {
			var rec Record
			if jerr := json.Unmarshal(trimmed, &rec); jerr != nil {
				if atEOF && !complete {
					return recs, nil // truncated by a killed run
				}
				return recs, fmt.Errorf("line %d: %w", lineNo, jerr)
			}
			recs = append(recs, rec)
		}
		if atEOF {
			return recs, nil
		}
	}
}

// CSVHeader is the header row WriteCSV writes; the columns follow Record's JSON names.
var CSVHeader = []string{
	"kind", "time", "step", "epoch", "loss", "lr", "scale", "grad_norm", "samples_per_sec",
	"skipped", "heap_bytes", "rss_bytes", "available_bytes", "max_heap_bytes", "live_heap_bytes", "swap_in_rate", "swap_out_rate",
	"phase_seconds", "memory", "phase_heap", "gpu", "accuracy", "samples",
	"oom_skipped", "event", "detail", "gen", "world", "members",
	"old_world", "source", "lost_steps", "resume_seconds",
}

// WriteCSV writes recs as CSV with a header row. Fields that the JSON form omits when zero
// (lr, scale, accuracy, ...) are left empty when zero, so that spreadsheet and pandas users see
// "not recorded" for an eval row's learning rate rather than a learning rate of 0. Non-finite
// numbers are written as NaN, +Inf and -Inf, which pandas reads back.
func WriteCSV(w io.Writer, recs []Record) error {
	cw := csv.NewWriter(w)
	if err := cw.Write(CSVHeader); err != nil {
		return fmt.Errorf("writing CSV header: %w", err)
	}
	row := make([]string, len(CSVHeader))
	for i := range recs {
		r := &recs[i]
		row = append(row[:0],
			r.Kind,
			strconv.FormatFloat(r.Time, 'f', -1, 64),
			strconv.FormatInt(r.Step, 10),
			formatFloat(r.Epoch),
			formatFloat(r.Loss),
			optFloat(r.LR),
			optFloat(r.Scale),
			optFloat(r.GradNorm),
			optFloat(r.SamplesPerSec),
			strconv.FormatBool(r.Skipped),
			optUint(r.HeapBytes),
			optUint(r.RSSBytes),
			optUint(r.AvailableBytes),
			optUint(r.MaxHeapBytes),
			optUint(r.LiveHeapBytes),
			optFloat(r.SwapInRate),
			optFloat(r.SwapOutRate),
			formatPairs(r.PhaseSeconds, formatFloat),
			formatMemory(r.Memory),
			formatMemory(r.PhaseHeap),
			formatMemory(r.GPU),
			optFloat(r.Accuracy),
			optInt(int64(r.Samples)),
			optInt(int64(r.OOMSkipped)),
			r.Event,
			r.Detail,
			optUint(r.Gen),
			optInt(int64(r.World)),
			formatMembers(r.Members),
			optInt(int64(r.OldWorld)),
			r.Source,
			optInt(r.LostSteps),
			optFloat(r.ResumeSeconds),
		)
		if err := cw.Write(row); err != nil {
			return fmt.Errorf("writing CSV row %d (step %d): %w", i+1, r.Step, err)
		}
	}
	cw.Flush()
	if err := cw.Error(); err != nil {
		return fmt.Errorf("writing CSV: %w", err)
	}
	return nil
}

func formatFloat(v float64) string {
	return strconv.FormatFloat(v, 'g', -1, 64)
}

func optFloat(v float64) string {
	if v == 0 {
		return ""
	}
	return formatFloat(v)
}

func optInt(v int64) string {
	if v == 0 {
		return ""
	}
	return strconv.FormatInt(v, 10)
}

func optUint(v uint64) string {
	if v == 0 {
		return ""
	}
	return strconv.FormatUint(v, 10)
}

// formatMemory writes the memory categories as "name=bytes" pairs sorted by name and joined
// by spaces, one cell that a spreadsheet keeps together.
func formatMemory(m map[string]int64) string {
	return formatPairs(m, func(v int64) string { return strconv.FormatInt(v, 10) })
}

// formatPairs writes m as "name=value" pairs sorted by name and joined by spaces.
func formatPairs[V any](m map[string]V, format func(V) string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + format(m[k])
	}
	return strings.Join(parts, " ")
}

// formatMembers writes a members record's list as JSON, one cell: a table in a table would
// need columns per member.
func formatMembers(ms []Member) string {
	if len(ms) == 0 {
		return ""
	}
	b, err := json.Marshal(ms)
	if err != nil {
		return "" // Member has no field encoding/json rejects
	}
	return string(b)
}
