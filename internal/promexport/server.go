package promexport

import (
	"fmt"
	"net/http"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/qvd/qvd/internal/httpserve"
)

// Listen starts serving e's registry on addr's /metrics (HOST:PORT; port 0 picks a free one:
// Addr tells which) until Close.
func (e *Exporter) Listen(addr string) (*httpserve.Server, error) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(e.reg, promhttp.HandlerOpts{Registry: e.reg}))
	s, err := httpserve.Listen(addr, mux)
	if err != nil {
		return nil, fmt.Errorf("serving metrics on %s: %w", addr, err)
	}
	return s, nil
}
