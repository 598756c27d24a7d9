package metrics

import (
	"encoding/json"
	"math"
	"strconv"
)

// plainRecord has Record's fields and tags but none of its methods, so json.Marshal on it uses
// the standard encoding without recursing into Record.MarshalJSON.
type plainRecord Record

// MarshalJSON encodes r as one JSON object with the field names of Record's tags. Non-finite
// floats, which encoding/json rejects, are written as null: a diverged step must still reach
// the file, since it is exactly the step someone will want to look at.
func (r Record) MarshalJSON() ([]byte, error) {
	if r.finite() {
		return json.Marshal(plainRecord(r))
	}
	return json.Marshal(r.toWire())
}

// UnmarshalJSON decodes one record; a null float field decodes as NaN (see MarshalJSON).
func (r *Record) UnmarshalJSON(b []byte) error {
	var w wireRecord
	if err := json.Unmarshal(b, &w); err != nil {
		return err
	}
	*r = w.record()
	return nil
}

func (r *Record) finite() bool {
	for _, f := range [...]float64{r.Time, r.Epoch, r.Loss, r.LR, r.Scale, r.GradNorm, r.SamplesPerSec, r.SwapInRate, r.SwapOutRate, r.Accuracy} {
		if math.IsNaN(f) || math.IsInf(f, 0) {
			return false
		}
	}
	return true
}

// nullableFloat is a float64 that encodes non-finite values as JSON null and decodes null as
// NaN. omitempty still applies to it because encoding/json tests emptiness on the kind.
type nullableFloat float64

func (f nullableFloat) MarshalJSON() ([]byte, error) {
	v := float64(f)
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return []byte("null"), nil
	}
	// Same choice of notation as encoding/json, so the two encoding paths look alike:
	// plain decimals for the ordinary range, exponents for the very small and very large.
	format := byte('f')
	if a := math.Abs(v); a != 0 && (a < 1e-6 || a >= 1e21) {
		format = 'e'
	}
	return strconv.AppendFloat(nil, v, format, -1, 64), nil
}

func (f *nullableFloat) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		*f = nullableFloat(math.NaN())
		return nil
	}
	v, err := strconv.ParseFloat(string(b), 64)
	if err != nil {
		return err
	}
	*f = nullableFloat(v)
	return nil
}

// wireRecord mirrors Record field for field (TestWireRecordMirrorsRecord keeps them in step),
// with the floats made nullable.
type wireRecord struct {
	Kind  string        `json:"kind"`
	Time  nullableFloat `json:"time"`
	Step  int64         `json:"step"`
	Epoch nullableFloat `json:"epoch"`
	Loss  nullableFloat `json:"loss"`

	LR            nullableFloat `json:"lr,omitempty"`
	Scale         nullableFloat `json:"scale,omitempty"`
	GradNorm      nullableFloat `json:"grad_norm,omitempty"`
	SamplesPerSec nullableFloat `json:"samples_per_sec,omitempty"`
	Skipped       bool          `json:"skipped,omitempty"`

	HeapBytes uint64 `json:"heap_bytes,omitempty"`
	RSSBytes  uint64 `json:"rss_bytes,omitempty"`

	AvailableBytes uint64        `json:"available_bytes,omitempty"`
	MaxHeapBytes   uint64        `json:"max_heap_bytes,omitempty"`
	LiveHeapBytes  uint64        `json:"live_heap_bytes,omitempty"`
	SwapInRate     nullableFloat `json:"swap_in_rate,omitempty"`
	SwapOutRate    nullableFloat `json:"swap_out_rate,omitempty"`

	PhaseSeconds map[string]float64 `json:"phase_seconds,omitempty"`
	Memory       map[string]int64   `json:"memory,omitempty"`
	PhaseHeap    map[string]int64   `json:"phase_heap,omitempty"`
	GPU          map[string]int64   `json:"gpu,omitempty"`

	Accuracy nullableFloat `json:"accuracy,omitempty"`
	Samples  int           `json:"samples,omitempty"`

	OOMSkipped int `json:"oom_skipped,omitempty"`

	Event  string `json:"event,omitempty"`
	Detail string `json:"detail,omitempty"`
	Gen    uint64 `json:"gen,string,omitempty"`
	World  int    `json:"world,omitempty"`

	Members []Member `json:"members,omitempty"`

	OldWorld      int           `json:"old_world,omitempty"`
	Source        string        `json:"source,omitempty"`
	LostSteps     int64         `json:"lost_steps,omitempty"`
	ResumeSeconds nullableFloat `json:"resume_seconds,omitempty"`
}

func (r *Record) toWire() wireRecord {
	return wireRecord{
		Kind:           r.Kind,
		Time:           nullableFloat(r.Time),
		Step:           r.Step,
		Epoch:          nullableFloat(r.Epoch),
		Loss:           nullableFloat(r.Loss),
		LR:             nullableFloat(r.LR),
		Scale:          nullableFloat(r.Scale),
		GradNorm:       nullableFloat(r.GradNorm),
		SamplesPerSec:  nullableFloat(r.SamplesPerSec),
		Skipped:        r.Skipped,
		HeapBytes:      r.HeapBytes,
		RSSBytes:       r.RSSBytes,
		AvailableBytes: r.AvailableBytes,
		MaxHeapBytes:   r.MaxHeapBytes,
		LiveHeapBytes:  r.LiveHeapBytes,
		SwapInRate:     nullableFloat(r.SwapInRate),
		SwapOutRate:    nullableFloat(r.SwapOutRate),
		PhaseSeconds:   r.PhaseSeconds,
		Memory:         r.Memory,
		PhaseHeap:      r.PhaseHeap,
		GPU:            r.GPU,
		Accuracy:       nullableFloat(r.Accuracy),
		Samples:        r.Samples,
		OOMSkipped:     r.OOMSkipped,
		Event:          r.Event,
		Detail:         r.Detail,
		Gen:            r.Gen,
		World:          r.World,
		OldWorld:       r.OldWorld,
		Source:         r.Source,
		LostSteps:      r.LostSteps,
		ResumeSeconds:  nullableFloat(r.ResumeSeconds),
		Members:        r.Members,
	}
}

func (w *wireRecord) record() Record {
	return Record{
		Kind:           w.Kind,
		Time:           float64(w.Time),
		Step:           w.Step,
		Epoch:          float64(w.Epoch),
		Loss:           float64(w.Loss),
		LR:             float64(w.LR),
		Scale:          float64(w.Scale),
		GradNorm:       float64(w.GradNorm),
		SamplesPerSec:  float64(w.SamplesPerSec),
		Skipped:        w.Skipped,
		HeapBytes:      w.HeapBytes,
		RSSBytes:       w.RSSBytes,
		AvailableBytes: w.AvailableBytes,
		MaxHeapBytes:   w.MaxHeapBytes,
		LiveHeapBytes:  w.LiveHeapBytes,
		SwapInRate:     float64(w.SwapInRate),
		SwapOutRate:    float64(w.SwapOutRate),
		PhaseSeconds:   w.PhaseSeconds,
		Memory:         w.Memory,
		PhaseHeap:      w.PhaseHeap,
		GPU:            w.GPU,
		Accuracy:       float64(w.Accuracy),
		Samples:        w.Samples,
		OOMSkipped:     w.OOMSkipped,
		Event:          w.Event,
		Detail:         w.Detail,
		Gen:            w.Gen,
		World:          w.World,
		OldWorld:       w.OldWorld,
		Source:         w.Source,
		LostSteps:      w.LostSteps,
		ResumeSeconds:  float64(w.ResumeSeconds),
		Members:        w.Members,
	}
}
