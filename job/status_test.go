package job

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/metrics"
)

// Records as rank 0 writes them (job/dashboard.go, job/elastic.go): the rendezvous, steps,
// re-forms (a loss, then members admitted), a stop.
var (
	stRdvA    = metrics.Record{Kind: metrics.KindEvent, Time: 1000, Event: metrics.EventRendezvous, Detail: "job mlp-aaaa", Gen: 5000, World: 4}
	stRdvB    = metrics.Record{Kind: metrics.KindEvent, Time: 3000, Event: metrics.EventRendezvous, Detail: "job mlp-bbbb", Gen: 9000, World: 2}
	stLost    = metrics.Record{Kind: metrics.KindEvent, Time: 1011, Event: metrics.EventMemberLost, Detail: "rank 2 (worker2) failed"}
	stShrink  = metrics.Record{Kind: metrics.KindEvent, Time: 1012.5, Step: 40, Event: metrics.EventReform, Detail: "step 41: peer connection lost", Gen: 5001, World: 3, OldWorld: 4, Source: metrics.SourceMemory, LostSteps: 1, ResumeSeconds: 0.92}
	stGrow    = metrics.Record{Kind: metrics.KindEvent, Time: 1030, Step: 90, Event: metrics.EventReform, Detail: "admitted 1 members", Gen: 5002, World: 4, OldWorld: 3, Source: metrics.SourceMemory, ResumeSeconds: 1.5}
	stStopped = metrics.Record{Kind: metrics.KindEvent, Time: 1040, Step: 120, Event: metrics.EventStopped, Detail: "failed: disk full"}
)

func stStep(n int64, at float64) metrics.Record {
	return metrics.Record{Kind: metrics.KindTrain, Time: at, Step: n, Loss: 0.5}
}

func TestRunStatus(t *testing.T) {
	for _, tc := range []struct {
		name string
		recs []metrics.Record
		want RunStatus
	}{
		{"empty file", nil, RunStatus{World: 1, Generation: 1}},
		{"single process: no rendezvous", []metrics.Record{stStep(1, 10), stStep(2, 11)},
			RunStatus{World: 1, Generation: 1, Step: 2, StepTime: 11}},
		{"rendezvous, no re-form", []metrics.Record{stRdvA, stStep(1, 1001), {Kind: metrics.KindEval, Time: 1002, Step: 1, Accuracy: 0.8}},
			RunStatus{Job: "mlp-aaaa", World: 4, Generation: 1, Step: 1, StepTime: 1001}},
		{"a loss: world 3, generation 2", []metrics.Record{stRdvA, stStep(41, 1010), stLost, stStep(41, 1012.5), stShrink},
			RunStatus{Job: "mlp-aaaa", World: 3, Generation: 2, Step: 41, StepTime: 1012.5, Reforms: []metrics.Record{stShrink}}},
		{"lost and taken back: world 4, generation 3", []metrics.Record{stRdvA, stStep(41, 1010), stLost, stShrink, stStep(90, 1029), stGrow, stStep(91, 1031)},
			RunStatus{Job: "mlp-aaaa", World: 4, Generation: 3, Step: 91, StepTime: 1031, Reforms: []metrics.Record{stShrink, stGrow}}},
		{"stopped after a re-form", []metrics.Record{stRdvA, stShrink, stStep(120, 1039), stStopped},
			RunStatus{Job: "mlp-aaaa", World: 3, Generation: 2, Step: 120, StepTime: 1039, Reforms: []metrics.Record{stShrink}, Stopped: &stStopped}},
		// A run resumed into the same directory is a new job: the old job's re-forms and stop
		// are not its own.
		{"resumed: the last job counts", []metrics.Record{stRdvA, stShrink, stStep(120, 1039), stStopped, stRdvB, stStep(121, 3001)},
			RunStatus{Job: "mlp-bbbb", World: 2, Generation: 1, Step: 121, StepTime: 3001}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := runStatus(tc.recs); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("runStatus:\n got %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

func TestFormatRunStatus(t *testing.T) {
	loc := time.FixedZone("X", 3600)
	s := RunStatus{Path: "runs/a/metrics.jsonl", Job: "mlp-aaaa", World: 4, Generation: 3, Step: 120, StepTime: 1039,
		Reforms: []metrics.Record{stShrink, stGrow}, Stopped: &stStopped}
	var b strings.Builder
	if err := FormatRunStatus(&b, s, loc); err != nil {
		t.Fatal(err)
	}
	want := `run:        runs/a/metrics.jsonl
job:        mlp-aaaa
world:      4 (generation 3: 2 re-forms, the last at 1970-01-01 01:17:10)
last step:  120 at 1970-01-01 01:17:19
stopped:    after step 120 at 1970-01-01 01:17:20: failed: disk full

GEN  RESUMED AT           FROM STEP  WORLD   SOURCE  LOST STEPS  RESUME  CAUSE
2    1970-01-01 01:16:52  40         4 -> 3  memory  1           0.92 s  step 41: peer connection lost
3    1970-01-01 01:17:10  90         3 -> 4  memory  0           1.50 s  admitted 1 members
`
	if b.String() != want {
		t.Errorf("got:\n%s\nwant:\n%s", b.String(), want)
	}

	// A single-process run that has not stepped yet: no job line, no table.
	b.Reset()
	if err := FormatRunStatus(&b, RunStatus{Path: "m.jsonl", World: 1, Generation: 1}, loc); err != nil {
		t.Fatal(err)
	}
	want = "run:        m.jsonl\nworld:      1 (generation 1: no re-forms)\nlast step:  none yet\n"
	if b.String() != want {
		t.Errorf("got:\n%s\nwant:\n%s", b.String(), want)
	}
}

// TestReadRunStatus reads a file written by metrics.Writer, as rank 0 writes it, through the
// run directory and through the file's own path; a path that is not there is a peer.
func TestReadRunStatus(t *testing.T) {
	dir := t.TempDir()
	w, err := metrics.Create(filepath.Join(dir, "metrics.jsonl"), false)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []metrics.Record{stRdvA, stStep(41, 1010), stLost, stShrink, stStep(90, 1029), stGrow, stStep(91, 1031)} {
		if err := w.Write(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	for _, arg := range []string{dir, filepath.Join(dir, "metrics.jsonl")} {
		path, ok := RunStatusPath(arg)
		if !ok {
			t.Fatalf("RunStatusPath(%s): not a run", arg)
		}
		s, err := ReadRunStatus(path)
		if err != nil {
			t.Fatal(err)
		}
		if s.Path != filepath.Join(dir, "metrics.jsonl") || s.Job != "mlp-aaaa" || s.World != 4 || s.Generation != 3 || len(s.Reforms) != 2 ||
			s.Reforms[0].ResumeSeconds != 0.92 || s.Reforms[1].Detail != "admitted 1 members" {
			t.Errorf("ReadRunStatus(%s) = %+v", path, s)
		}
	}
	for _, peer := range []string{"node0:7946", filepath.Join(dir, "missing")} {
		if path, ok := RunStatusPath(peer); ok {
			t.Errorf("RunStatusPath(%s) = %s, want a peer", peer, path)
		}
	}
	// An empty directory is a run without metrics: an error naming the file.
	empty := t.TempDir()
	path, _ := RunStatusPath(empty)
	if _, err := ReadRunStatus(path); err == nil || !strings.Contains(err.Error(), "metrics.jsonl") {
		t.Errorf("ReadRunStatus of an empty run directory: %v", err)
	}
	if err := os.WriteFile(filepath.Join(empty, "metrics.jsonl"), []byte("{not json}\n{}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadRunStatus(path); err == nil || !strings.Contains(err.Error(), "line 1") {
		t.Errorf("ReadRunStatus of a malformed file: %v", err)
	}
}
