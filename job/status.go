package job

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"go.uber.org/zap"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/internal/metrics"
)

// Status joins the cluster at peer as a short-lived observer and returns its members (as
// qvd status prints them), giving up after o.Timeout. A key or TLS files it cannot use are
// configs.ErrInvalid; a failed join is not.
func Status(ctx context.Context, peer string, o ObserverOptions) ([]cluster.Member, error) {
	cfg, err := o.clusterConfig("status-")
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, o.Timeout)
	defer cancel()
	return cluster.Status(ctx, cfg, peer, zap.NewNop())
}

// RunStatus is what a run's metrics.jsonl tells of its job's group: rank 0 records the
// rendezvous and every re-form there as they happen (a rank 0 that takes over after a loss
// goes on in the same file), so the file holds the job's history even after gossip has
// forgotten the members it lost. It describes the last job in the file: a run resumed into
// the same directory starts a new job with its own rendezvous.
type RunStatus struct {
	Path string // the metrics file
	// Job is the job's id, "" for a single-process run (no rendezvous record).
	Job string
	// World is the group's size now: the last re-form's, else the rendezvous's (1 without).
	World int
	// Generation counts the job's groups: 1 at the rendezvous, one more with each re-form.
	Generation int
	// Step and StepTime are the last recorded training step and when it completed (Unix
	// seconds); 0 before the first.
	Step     int64
	StepTime float64
	// Reforms are the job's re-form records, oldest first (metrics.EventReform).
	Reforms []metrics.Record
	// Stopped is the record of a run that ended before its last step, nil otherwise.
	Stopped *metrics.Record
}

// RunStatusPath reads qvd status's argument as a run: an existing directory means its
// metrics.jsonl, an existing file that file. ok is false for anything else, which is a
// peer's gossip address.
func RunStatusPath(arg string) (path string, ok bool) {
	st, err := os.Stat(arg)
	switch {
	case err != nil:
		return "", false
	case st.IsDir():
		return filepath.Join(arg, "metrics.jsonl"), true
	}
	return filepath.Clean(arg), true
}

// ReadRunStatus reads the metrics file at path (see RunStatusPath) into a RunStatus.
func ReadRunStatus(path string) (RunStatus, error) {
	recs, err := metrics.ReadFile(path)
	if err != nil {
		return RunStatus{}, fmt.Errorf("run status: %w", err)
	}
	s := runStatus(recs)
	s.Path = path
	return s, nil
}

// runStatus summarises recs, a metrics file's records in file order.
func runStatus(recs []metrics.Record) RunStatus {
	s := RunStatus{World: 1, Generation: 1}
	for i := range recs {
		r := &recs[i]
		switch {
		case r.Kind == metrics.KindTrain:
			s.Step, s.StepTime = r.Step, r.Time
		case r.Kind != metrics.KindEvent:
		case r.Event == metrics.EventRendezvous:
			// A new job in the same directory: what came before is another job's.
			s = RunStatus{Job: strings.TrimPrefix(r.Detail, "job "), World: max(r.World, 1), Generation: 1, Step: s.Step, StepTime: s.StepTime}
		case r.Event == metrics.EventReform:
			s.Reforms = append(s.Reforms, *r)
			s.World, s.Generation = r.World, s.Generation+1
		case r.Event == metrics.EventStopped:
			s.Stopped = r
		}
	}
	return s
}

// FormatRunStatus prints s for people: the job, its group now, and each re-form with its
// cause. Times are in loc.
func FormatRunStatus(w io.Writer, s RunStatus, loc *time.Location) error {
	at := func(t float64) string {
		return time.Unix(0, int64(t*1e9)).In(loc).Format("2006-01-02 15:04:05")
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "run:\t%s\n", s.Path)
	if s.Job != "" {
		fmt.Fprintf(tw, "job:\t%s\n", s.Job)
	}
	reforms := "no re-forms"
	if n := len(s.Reforms); n > 0 {
		last := s.Reforms[n-1]
		reforms = fmt.Sprintf("%d re-form%s, the last at %s", n, plural(n), at(last.Time))
	}
	fmt.Fprintf(tw, "world:\t%d (generation %d: %s)\n", s.World, s.Generation, reforms)
	if s.StepTime > 0 {
		fmt.Fprintf(tw, "last step:\t%d at %s\n", s.Step, at(s.StepTime))
	} else {
		fmt.Fprintf(tw, "last step:\tnone yet\n")
	}
	if s.Stopped != nil {
		fmt.Fprintf(tw, "stopped:\tafter step %d at %s: %s\n", s.Stopped.Step, at(s.Stopped.Time), s.Stopped.Detail)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("print run status: %w", err)
	}
	if len(s.Reforms) == 0 {
		return nil
	}
	// ResumeSeconds runs from the loss to the first step at the new world, so the re-form
	// began that long before the record's time.
	fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GEN\tRESUMED AT\tFROM STEP\tWORLD\tSOURCE\tLOST STEPS\tRESUME\tCAUSE")
	for i, r := range s.Reforms {
		resume := "-"
		if r.ResumeSeconds > 0 {
			resume = strconv.FormatFloat(r.ResumeSeconds, 'f', 2, 64) + " s"
		}
		fmt.Fprintf(tw, "%d\t%s\t%d\t%d -> %d\t%s\t%d\t%s\t%s\n", i+2, at(r.Time), r.Step, r.OldWorld, r.World, orDash(r.Source), r.LostSteps, resume, orDash(r.Detail))
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("print run status: %w", err)
	}
	return nil
}

func plural(n int) string {
	if n == 1 {
		return ""
	}
	return "s"
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
