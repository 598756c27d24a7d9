// Package httpserve runs the small HTTP servers a rank offers beside training (Prometheus's
// /metrics, the dashboard): it listens, serves from a goroutine it owns, and stops with a
// short grace for a request in flight. It also checks the HOST:PORT such a server is given.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
package httpserve

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"
)

const (
	// readHeaderTimeout bounds how long a client may take to send its request headers, so a
	// stalled connection cannot hold a handler goroutine.
	readHeaderTimeout = 5 * time.Second
	// shutdownGrace is how long Close lets a request in flight finish.
	shutdownGrace = time.Second
)

// Server serves one handler until Close.
type Server struct {
	srv  *http.Server
	ln   net.Listener
	wg   sync.WaitGroup
	once sync.Once
	err  error // Serve's error, other than the one Close causes; read after wg.Wait
}

// Listen starts serving h on addr (HOST:PORT; port 0 picks a free one: Addr tells which).
func Listen(addr string, h http.Handler) (*Server, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s := &Server{srv: &http.Server{Handler: h, ReadHeaderTimeout: readHeaderTimeout}, ln: ln}
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

// URL is the server's root page.
func (s *Server) URL() string { return "http://" + s.Addr() + "/" }

// Close stops the server, letting a request in flight finish for a moment, and waits for its
// goroutine. Safe to call twice.
func (s *Server) Close() error {
	s.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		defer cancel()
		if err := s.srv.Shutdown(ctx); err != nil {
			_ = s.srv.Close() // the request did not finish in time
		}
		s.wg.Wait()
	})
	return s.err
}

// CheckAddr checks addr as HOST:PORT (HOST may be empty: every interface; port 0: a free
// one) and returns PORT.
func CheckAddr(addr string) (int, error) {
	_, p, err := net.SplitHostPort(addr)
	if err != nil {
		return 0, fmt.Errorf("want HOST:PORT (e.g. 127.0.0.1:9400, :9400, or port 0 for a free port), got %q: %w", addr, err)
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < 0 || port > 65535 {
		return 0, fmt.Errorf("port must be 0-65535, got %q", p)
	}
	return port, nil
}
