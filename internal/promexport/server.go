package promexport

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

const (
	// readHeaderTimeout bounds how long a client may take to send its request headers, so a
	// stalled connection cannot hold a handler goroutine (Prometheus sends them at once).
	readHeaderTimeout = 5 * time.Second
	// shutdownGrace is how long Close lets a scrape in flight finish.
	shutdownGrace = time.Second
)

// Server serves an Exporter's registry on /metrics.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	wg   sync.WaitGroup
	once sync.Once
	err  error // Serve's error, other than the one Close causes; read after wg.Wait
}

// Listen starts serving e on addr (HOST:PORT; port 0 picks a free one: Addr tells which)
// until Close.
func (e *Exporter) Listen(addr string) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("serving metrics on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(e.reg, promhttp.HandlerOpts{Registry: e.reg}))
	s := &Server{srv: &http.Server{Handler: mux, ReadHeaderTimeout: readHeaderTimeout}, ln: ln}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		if err := s.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.err = err
		}
	}()
	return s, nil
}

// Addr is the address the server listens on, with the port it got.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Close stops the server, letting a scrape in flight finish for a moment, and waits for its
// goroutine. Safe to call twice.
func (s *Server) Close() error {
	s.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		if err := s.srv.Shutdown(ctx); err != nil {
			_ = s.srv.Close() // the scrape did not finish in time
		}
		s.wg.Wait()
	})
	return s.err
}
