package monitor

import (
	"errors"
	"sync"
	"time"

	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/tbevents"
)

// Options are Open's per-run inputs.
type Options struct {
	// Resume is true for a run resumed from a checkpoint: files are appended to, not replaced.
	Resume bool
	// Hostname names the event file; default os.Hostname().
	Hostname string
	// Now stamps file names and times flushes; default time.Now.
	Now func() time.Time
}

// Sink writes metrics records to the enabled monitors.
type Sink struct {
	tb  *tbevents.Writer // nil: TensorBoard off
	csv *CSVWriter       // nil: CSV off

	mu struct {
		sync.Mutex
		scalars  []tbevents.Scalar // one record's, reused
		started  bool              // the resumed run's SessionLog START is written
		resuming bool
	}
}

// Open opens the monitors cfg enables; its directories must be resolved (Config.Resolve). With
// none enabled it returns a Sink that writes nothing.
func Open(cfg Config, opt Options) (*Sink, error) {
	s := &Sink{}
	s.mu.resuming = opt.Resume
	if cfg.TensorBoard.Enabled {
		w, err := tbevents.Create(cfg.TensorBoard.Dir, tbevents.Options{Hostname: opt.Hostname, Now: opt.Now, Replace: !opt.Resume})
		if err != nil {
			return nil, err
		}
		s.tb = w
	}
	if cfg.CSV.Enabled {
		c, err := CreateCSV(cfg.CSV.Dir, opt.Resume, opt.Now)
		if err != nil {
			s.Close()
			return nil, err
		}
		s.csv = c
	}
	return s, nil
}

// TensorBoardPath is the event file being written, or "" with TensorBoard off.
func (s *Sink) TensorBoardPath() string {
	if s.tb == nil {
		return ""
	}
	return s.tb.Path()
}

// Write writes r's scalars (see Scalars) to each monitor.
func (s *Sink) Write(r metrics.Record) error {
	if s.tb == nil && s.csv == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mu.scalars = Scalars(s.mu.scalars[:0], &r)
	if len(s.mu.scalars) == 0 {
		return nil
	}
	// Separate variables, not a slice: this runs every step and allocates nothing.
	var startErr, tbErr, csvErr error
	if s.tb != nil {
		if s.mu.resuming && !s.mu.started {
			s.mu.started = true
			startErr = s.tb.WriteEvent(&tbevents.Event{WallTime: r.Time, Step: r.Step, SessionStart: true})
		}
		tbErr = s.tb.WriteEvent(&tbevents.Event{WallTime: r.Time, Step: r.Step, Scalars: s.mu.scalars})
	}
	if s.csv != nil {
		csvErr = s.csv.Write(r.Step, s.mu.scalars)
	}
	return errors.Join(startErr, tbErr, csvErr)
}

// Close flushes and closes the monitors' files. Calling it again returns nil.
func (s *Sink) Close() error {
	var errs []error
	if s.tb != nil {
		errs = append(errs, s.tb.Close())
	}
	if s.csv != nil {
		errs = append(errs, s.csv.Close())
	}
	return errors.Join(errs...)
}
