package job

import (
	"go.uber.org/zap"

	"github.com/qvd/qvd/internal/promexport"
)

// serveMetrics starts this rank's Prometheus endpoint when the job has one: on the worker's
// own --metrics-addr if it gave one, else on monitoring.metrics_addr with the port offset by
// the rank (promexport.RankAddr). It returns the exporter to add to the metrics sink (nil:
// none) and the function that stops the server.
func (j *job) serveMetrics() (*promexport.Exporter, func(), error) {
	addr := j.metricsAddr
	if addr == "" && j.cfg.Monitoring.MetricsAddr != "" {
		var err error
		if addr, err = promexport.RankAddr(j.cfg.Monitoring.MetricsAddr, j.rank); err != nil {
			return nil, nil, err
		}
	}
	if addr == "" {
		return nil, func() {}, nil
	}
	o := promexport.Options{Rank: j.rank, World: j.world, Wire: j.wire}
	if j.roster != nil {
		o.Generation = j.roster.Gen
	}
	e, err := promexport.New(o)
	if err != nil {
		return nil, nil, err
	}
	s, err := e.Listen(addr)
	if err != nil {
		return nil, nil, err
	}
	j.log.Info("serving Prometheus metrics", zap.String("metrics_url", "http://"+s.Addr()+"/metrics"))
	return e, func() {
		if err := s.Close(); err != nil {
			j.log.Warn("the metrics endpoint failed", zap.String("addr", s.Addr()), zap.Error(err))
		}
	}, nil
}
