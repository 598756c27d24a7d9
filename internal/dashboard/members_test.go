package dashboard

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/internal/metrics"
)

// fakeMembers is a MemberSource a test sets.
type fakeMembers struct{ ms []metrics.Member }

func (f *fakeMembers) Members() []metrics.Member { return slices.Clone(f.ms) }

func getMembers(t *testing.T, h http.Handler) MembersResponse {
	t.Helper()
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/members", nil))
	if rec.Code != http.StatusOK || rec.Header().Get("Content-Type") != "application/json" {
		t.Fatalf("GET /api/members: %d %q %s", rec.Code, rec.Header().Get("Content-Type"), rec.Body)
	}
	var resp MembersResponse
	if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
		t.Fatalf("GET /api/members: %v\n%s", err, rec.Body)
	}
	return resp
}

// TestDashboardMembersEndpoint: without a member source /api/members says it is not live
// (the page then uses the file's members records); with one it returns the source's
// members with rank, step, generation, state and memory, the generation as a string (a
// nanosecond clock does not fit a JavaScript number).
func TestDashboardMembersEndpoint(t *testing.T) {
	path := filepath.Join(t.TempDir(), "metrics.jsonl")
	if r := getMembers(t, New(path, "")); r.Live || len(r.Members) != 0 {
		t.Fatalf("no source: live %v, %d members; want false and none", r.Live, len(r.Members))
	}
	src := &fakeMembers{ms: []metrics.Member{
		{Name: "n0", State: "alive", Role: "coordinator", Rank: 0, Step: 41, Gen: 1732450000123456789, Model: 3 << 20, RSS: 200 << 20, Peak: 90 << 20},
		{Name: "n1", State: "dead", Role: "worker", Rank: 1, Step: 40, Gen: 7},
	}}
	h := New(path, "", WithMembers(src, "gossip through 127.0.0.1:7946"))
	h.now = func() time.Time { return time.Unix(1700000000, 0) }
	r := getMembers(t, h)
	if !r.Live || r.Source != "gossip through 127.0.0.1:7946" || r.Time != 1700000000 || !slices.Equal(r.Members, src.ms) {
		t.Fatalf("got %+v, want live members %+v", r, src.ms)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/api/members", nil))
	if want := `"gen":"1732450000123456789"`; !json.Valid(rec.Body.Bytes()) || !strings.Contains(rec.Body.String(), want) {
		t.Fatalf("body %s lacks %s", rec.Body, want)
	}
}

// TestDashboardNoFile: a dashboard of a cluster alone (path "") answers /api/metrics with no
// records and no_file set, rather than an error.
func TestDashboardNoFile(t *testing.T) {
	r := get(t, New("", "cluster at x:1", WithMembers(&fakeMembers{}, "")), "/api/metrics?since=0")
	if !r.NoFile || len(r.Records) != 0 || r.Title != "cluster at x:1" {
		t.Fatalf("got %+v, want no_file and no records", r)
	}
}

// TestMembersLog: a members record is due at the first step, again when a member's state,
// rank or name changes, and otherwise only once Every has passed.
func TestMembersLog(t *testing.T) {
	src := &fakeMembers{ms: []metrics.Member{{Name: "a", State: "alive", Rank: 0, Step: 1}, {Name: "b", State: "alive", Rank: 1, Step: 1}}}
	l := &MembersLog{Source: src, Every: 10 * time.Second}
	t0 := time.Unix(1700000000, 0)
	for _, tc := range []struct {
		at     time.Duration
		change func()
		due    bool
	}{
		{0, nil, true},
		{time.Second, func() { src.ms[0].Step = 2 }, false}, // a step is not a change of membership
		{2 * time.Second, func() { src.ms[1].State = "dead" }, true},
		{3 * time.Second, nil, false},
		{13 * time.Second, nil, true}, // Every passed
		{14 * time.Second, func() { src.ms = src.ms[:1] }, true},
	} {
		if tc.change != nil {
			tc.change()
		}
		rec, due := l.Record(7, t0.Add(tc.at))
		if due != tc.due {
			t.Fatalf("at %v: due %v, want %v", tc.at, due, tc.due)
		}
		if due && (rec.Kind != metrics.KindMembers || rec.Step != 7 || !slices.Equal(rec.Members, src.ms)) {
			t.Fatalf("at %v: record %+v", tc.at, rec)
		}
	}
	// At the end of the run the members are written whether due or not.
	if rec := l.Final(9, t0.Add(15*time.Second)); rec.Kind != metrics.KindMembers || rec.Step != 9 || !slices.Equal(rec.Members, src.ms) {
		t.Fatalf("final record %+v", rec)
	}
}

// TestSortMembers: live members first, ranked by rank, then unranked by name; gone last.
func TestSortMembers(t *testing.T) {
	ms := []metrics.Member{
		{Name: "obs", State: "alive", Rank: -1}, {Name: "r2", State: "dead", Rank: 2}, {Name: "r1", State: "alive", Rank: 1},
		{Name: "r0", State: "alive", Rank: 0}, {Name: "idle", State: "alive", Rank: -1}, {Name: "r3", State: StateMissing, Rank: 3},
	}
	SortMembers(ms)
	var names []string
	for _, m := range ms {
		names = append(names, m.Name)
	}
	if want := []string{"r0", "r1", "idle", "obs", "r2", "r3"}; !slices.Equal(names, want) {
		t.Fatalf("order %v, want %v", names, want)
	}
}
