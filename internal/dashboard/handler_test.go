package dashboard

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/metrics"
)

// writeRecords appends recs to path as the metrics Writer does: one JSON object per line.
func writeRecords(t *testing.T, path string, recs ...metrics.Record) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, r := range recs {
		b, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := f.Write(append(b, '\n')); err != nil {
			t.Fatal(err)
		}
	}
}

func appendBytes(t *testing.T, path, s string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteString(s); err != nil {
		t.Fatal(err)
	}
}

func get(t *testing.T, h http.Handler, url string) Response {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, url, nil))
	if rec.Code != http.StatusOK {
		t.Fatalf("GET %s: %d %s", url, rec.Code, rec.Body)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("GET %s: Content-Type %q", url, ct)
	}
	var resp Response
	if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
		t.Fatalf("GET %s: %v\n%s", url, err, rec.Body)
	}
	if !strings.Contains(rec.Body.String(), `"records":[`) {
		t.Fatalf("GET %s: records is not a list: %s", url, rec.Body)
	}
	return resp
}

func steps(recs []metrics.Record) []int64 {
	s := make([]int64, len(recs))
	for i, r := range recs {
		s[i] = r.Step
	}
	return s
}

func trainRec(step int64) metrics.Record {
	return metrics.Record{Kind: metrics.KindTrain, Step: step, Loss: 2.3 / float64(step), SamplesPerSec: 1000,
		RSSBytes: 1 << 28, Memory: map[string]int64{"device_params": 4 << 20, "host_optimizer": 8 << 20}}
}

// TestDashboardMetricsSince: the endpoint returns the file's records in order, and since
// returns only those from that index on, with next telling the client where to go on.
func TestDashboardMetricsSince(t *testing.T) {
	path := filepath.Join(t.TempDir(), "metrics.jsonl")
	writeRecords(t, path, trainRec(1), trainRec(2),
		metrics.Record{Kind: metrics.KindEval, Step: 2, Loss: 0.9, Accuracy: 0.7, Samples: 200}, trainRec(3))
	h := New(path, "run-a")

	all := get(t, h, "/api/metrics")
	if got := steps(all.Records); len(got) != 4 || got[0] != 1 || got[2] != 2 || got[3] != 3 {
		t.Fatalf("steps %v, want [1 2 2 3]", got)
	}
	if all.Next != 4 || all.Title != "run-a" || all.Reset {
		t.Fatalf("next %d title %q reset %v, want 4, run-a, false", all.Next, all.Title, all.Reset)
	}
	if all.Records[2].Kind != metrics.KindEval || all.Records[2].Accuracy != 0.7 {
		t.Fatalf("record 2 = %+v, want the eval", all.Records[2])
	}
	if all.Records[0].Memory["host_optimizer"] != 8<<20 || all.Records[0].RSSBytes != 1<<28 {
		t.Fatalf("record 0 memory %v rss %d", all.Records[0].Memory, all.Records[0].RSSBytes)
	}

	tail := get(t, h, "/api/metrics?since=3")
	if got := steps(tail.Records); len(got) != 1 || got[0] != 3 || tail.Next != 4 {
		t.Fatalf("since=3: steps %v next %d, want [3] and 4", got, tail.Next)
	}
	if none := get(t, h, "/api/metrics?since=4"); len(none.Records) != 0 || none.Next != 4 {
		t.Fatalf("since=4: %d records next %d, want none and 4", len(none.Records), none.Next)
	}
	writeRecords(t, path, trainRec(4), trainRec(5))
	if more := get(t, h, "/api/metrics?since=4&gen=0"); !slices.Equal(steps(more.Records), []int64{4, 5}) || more.Next != 6 || more.Reset {
		t.Fatalf("after appending: steps %v next %d reset %v, want [4 5], 6, false", steps(more.Records), more.Next, more.Reset)
	}

	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/metrics?since=x", nil))
	if rec.Code != http.StatusBadRequest {
		t.Fatalf("since=x: %d, want 400", rec.Code)
	}
}

// TestDashboardPartialLine: a last line still being written is not returned, nor skipped as
// malformed, until its newline arrives; then it is returned once.
func TestDashboardPartialLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "metrics.jsonl")
	writeRecords(t, path, trainRec(1))
	b, _ := json.Marshal(trainRec(2))
	half := len(b) / 2
	appendBytes(t, path, string(b[:half]))
	h := New(path, "")

	r := get(t, h, "/api/metrics")
	if !slices.Equal(steps(r.Records), []int64{1}) || r.Next != 1 || r.Malformed != 0 {
		t.Fatalf("with a partial line: steps %v next %d malformed %d, want [1], 1, 0", steps(r.Records), r.Next, r.Malformed)
	}
	appendBytes(t, path, string(b[half:]))
	if r = get(t, h, "/api/metrics?since=1"); len(r.Records) != 0 || r.Malformed != 0 {
		t.Fatalf("still no newline: %d records, malformed %d, want none", len(r.Records), r.Malformed)
	}
	appendBytes(t, path, "\n")
	if r = get(t, h, "/api/metrics?since=1"); !slices.Equal(steps(r.Records), []int64{2}) || r.Next != 2 {
		t.Fatalf("line completed: steps %v next %d, want [2], 2", steps(r.Records), r.Next)
	}
	// A complete line that is not a record is skipped and counted, not fatal.
	appendBytes(t, path, "{not json\n")
	writeRecords(t, path, trainRec(3))
	if r = get(t, h, "/api/metrics?since=2"); !slices.Equal(steps(r.Records), []int64{3}) || r.Malformed != 1 {
		t.Fatalf("after a malformed line: steps %v malformed %d, want [3], 1", steps(r.Records), r.Malformed)
	}
}

// TestDashboardMissingFile: before the run writes its first record there is no file; the
// endpoint answers an empty list, and picks the records up once the file appears.
func TestDashboardMissingFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "metrics.jsonl")
	h := New(path, "")
	r := get(t, h, "/api/metrics?since=0")
	if len(r.Records) != 0 || r.Next != 0 {
		t.Fatalf("missing file: %d records next %d, want none and 0", len(r.Records), r.Next)
	}
	writeRecords(t, path, trainRec(1))
	if r = get(t, h, "/api/metrics?since=0"); !slices.Equal(steps(r.Records), []int64{1}) {
		t.Fatalf("after creating the file: steps %v, want [1]", steps(r.Records))
	}
}

// TestDashboardFileReplaced: a new run writing a shorter file in the same place makes the
// Tail start over, and a client polling with the old position gets everything with reset.
func TestDashboardFileReplaced(t *testing.T) {
	path := filepath.Join(t.TempDir(), "metrics.jsonl")
	writeRecords(t, path, trainRec(1), trainRec(2), trainRec(3))
	h := New(path, "")
	first := get(t, h, "/api/metrics")
	if first.Next != 3 {
		t.Fatalf("next %d, want 3", first.Next)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	writeRecords(t, path, trainRec(7))
	r := get(t, h, "/api/metrics?since=3&gen=0")
	if !r.Reset || !slices.Equal(steps(r.Records), []int64{7}) || r.Next != 1 || r.Gen == first.Gen {
		t.Fatalf("after replacing: reset %v steps %v next %d gen %d, want true, [7], 1, not %d", r.Reset, steps(r.Records), r.Next, r.Gen, first.Gen)
	}
}

// TestDashboardIndex: / serves the embedded page, which loads nothing from the network.
func TestDashboardIndex(t *testing.T) {
	h := New(filepath.Join(t.TempDir(), "metrics.jsonl"), "")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/", nil))
	body := rec.Body.String()
	if rec.Code != http.StatusOK || !strings.HasPrefix(rec.Header().Get("Content-Type"), "text/html") {
		t.Fatalf("GET /: %d %q", rec.Code, rec.Header().Get("Content-Type"))
	}
	for _, want := range []string{`id="loss"`, `id="accuracy"`, `id="throughput"`, `id="memory"`, `id="events"`, "api/metrics",
		`id="phases"`, `id="rankmem"`, `id="members"`, "api/members"} {
		if !strings.Contains(body, want) {
			t.Errorf("page lacks %s", want)
		}
	}
	for _, bad := range []string{"http://", "https://", "src=", "<link"} {
		if strings.Contains(body, bad) {
			t.Errorf("page refers to an outside resource (%q)", bad)
		}
	}
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/nosuch", nil))
	if rec.Code != http.StatusNotFound {
		t.Errorf("GET /nosuch: %d, want 404", rec.Code)
	}
}

// TestDashboardLongRun: a long run's records come in pieces of at most maxRecords, with more
// set until the client has caught up.
func TestDashboardLongRun(t *testing.T) {
	path := filepath.Join(t.TempDir(), "metrics.jsonl")
	recs := make([]metrics.Record, maxRecords+10)
	for i := range recs {
		recs[i] = metrics.Record{Kind: metrics.KindTrain, Step: int64(i + 1), Loss: 1}
	}
	writeRecords(t, path, recs...)
	h := New(path, "")
	r := get(t, h, "/api/metrics?since=0")
	if len(r.Records) != maxRecords || r.Next != maxRecords || !r.More || r.Records[0].Step != 1 {
		t.Fatalf("first piece: %d records next %d more %v, want %d, %d, true", len(r.Records), r.Next, r.More, maxRecords, maxRecords)
	}
	r = get(t, h, "/api/metrics?since="+strconv.Itoa(r.Next))
	if len(r.Records) != 10 || r.Next != maxRecords+10 || r.More || r.Records[0].Step != maxRecords+1 {
		t.Fatalf("second piece: %d records next %d more %v, want 10, %d, false", len(r.Records), r.Next, r.More, maxRecords+10)
	}
}
