package dashboard

import (
	_ "embed"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/qvd/qvd/internal/metrics"

	"github.com/qvd/qvd/internal/httpserve"
)

//go:embed index.html
var indexHTML []byte

const (
	// maxRecords caps one response, so the first poll of a long run (a train record is about
	// 650 bytes of JSON) arrives in pieces the page asks for back to back, not as one huge body.
	maxRecords = 5000
)

// Handler serves the page on /, the records on /api/metrics and the live members on
// /api/members.
type Handler struct {
	tail    *Tail // nil: no metrics file (a dashboard of a cluster, not of a run directory)
	title   string
	members MemberSource
	source  string // where members come from, for the page
	now     func() time.Time
	mux     *http.ServeMux
}

var _ http.Handler = (*Handler)(nil)

// Option configures a Handler.
type Option func(*Handler)

// WithMembers makes the page show src's members live; source says where they come from
// ("gossip through 10.0.0.1:7946"), for the page.
func WithMembers(src MemberSource, source string) Option {
	return func(h *Handler) { h.members, h.source = src, source }
}

// New returns a Handler for the metrics file at path (it need not exist yet; "" for none:
// the page then shows what a MemberSource gives); title names the run on the page.
func New(path, title string, opts ...Option) *Handler {
	h := &Handler{title: title, now: time.Now, mux: http.NewServeMux()}
	if path != "" {
		h.tail = NewTail(path)
	}
	for _, o := range opts {
		o(h)
	}
	h.mux.HandleFunc("GET /{$}", h.serveIndex)
	h.mux.HandleFunc("GET /api/metrics", h.serveMetrics)
	h.mux.HandleFunc("GET /api/members", h.serveMembers)
	return h
}

func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request) { h.mux.ServeHTTP(w, r) }

func (h *Handler) serveIndex(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	_, _ = w.Write(indexHTML)
}

// Response is the body of /api/metrics (see the package doc).
type Response struct {
	Title     string           `json:"title"`
	Records   []metrics.Record `json:"records"`
	Next      int              `json:"next"`
	More      bool             `json:"more"` // records beyond next are ready: poll again now
	Gen       int              `json:"gen"`
	Reset     bool             `json:"reset"`
	Malformed int              `json:"malformed"`
	NoFile    bool             `json:"no_file,omitempty"` // the dashboard reads no metrics file
}

// MembersResponse is the body of /api/members. Live is false when the dashboard has no
// cluster view (`qvd dashboard RUN_DIR`): the page then shows the last members record of
// the metrics file, if any.
type MembersResponse struct {
	Live    bool             `json:"live"`
	Source  string           `json:"source,omitempty"`
	Time    float64          `json:"time"` // when the view was read, seconds since the Unix epoch
	Members []metrics.Member `json:"members"`
}

func (h *Handler) serveMembers(w http.ResponseWriter, _ *http.Request) {
	resp := MembersResponse{Live: h.members != nil, Source: h.source, Time: float64(h.now().UnixNano()) / 1e9, Members: []metrics.Member{}}
	if h.members != nil {
		if ms := h.members.Members(); ms != nil {
			resp.Members = ms
		}
	}
	writeJSON(w, resp)
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_ = json.NewEncoder(w).Encode(v) // an error: the client went away
}

func (h *Handler) serveMetrics(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	since, err := intParam(q.Get("since"))
	if err != nil {
		http.Error(w, "since: "+err.Error(), http.StatusBadRequest)
		return
	}
	gen, err := intParam(q.Get("gen"))
	if err != nil {
		http.Error(w, "gen: "+err.Error(), http.StatusBadRequest)
		return
	}
	if h.tail == nil {
		writeJSON(w, Response{Title: h.title, Records: []metrics.Record{}, NoFile: true})
		return
	}
	s, err := h.tail.Poll(since, maxRecords)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	reset := (q.Has("gen") && gen != s.Gen) || since > s.Total
	if reset {
		// The client's view is of a file that has since been replaced: start it over.
		since = 0
		if s, err = h.tail.Poll(since, maxRecords); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
	}
	next := min(since, s.Total) + len(s.Records)
	resp := Response{Title: h.title, Records: s.Records, Next: next, More: next < s.Total, Gen: s.Gen, Reset: reset, Malformed: s.Malformed}
	if resp.Records == nil {
		resp.Records = []metrics.Record{} // [] rather than null for the page
	}
	writeJSON(w, resp)
}

func intParam(v string) (int, error) {
	if v == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("want a non-negative integer, got %q", v)
	}
	return n, nil
}

// Listen starts serving h on addr (HOST:PORT; port 0 picks a free one: Addr tells which).
func Listen(addr string, h http.Handler) (*httpserve.Server, error) {
	s, err := httpserve.Listen(addr, h)
	if err != nil {
		return nil, fmt.Errorf("serving the dashboard on %s: %w", addr, err)
	}
	return s, nil
}
