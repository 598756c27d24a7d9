package tcpnet

import (
	"crypto/tls"
	"errors"
	"fmt"
	"time"
)

// Config tunes the data plane. The defaults suit a trainer; tests shorten the timeouts.
type Config struct {
	// HandshakeTimeout bounds each connection's handshake: how long an accepted connection
	// may take to present its hello, how long it may wait for its job to register on this
	// listener (a peer may learn the roster a little before this process does), and how long
	// a dialler waits for the answering hello.
	HandshakeTimeout time.Duration
	// DialTimeout bounds how long a Send keeps retrying a dial to a peer that refuses
	// connections or does not answer the hello (not yet started, or dead), when the Send's
	// own ctx would allow longer.
	DialTimeout time.Duration
	// FinishTimeout bounds how long the rest of a frame whose Send was cut short by its ctx
	// may take to go out in the background. Finishing the frame keeps the connection in step
	// for later Sends; if the peer does not take it in time, the connection is given up.
	FinishTimeout time.Duration
	// SocketBuffer sets SO_SNDBUF and SO_RCVBUF of data connections in bytes; 0 leaves
	// Linux's buffer autotuning in charge. Setting them turns autotuning off for that socket
	// (see BenchmarkStream's figures in bench_test.go for what was measured).
	SocketBuffer int
	// KeepAlive is the idle time before TCP keepalive probes start (then every KeepAlive/3,
	// three probes), so a peer whose host vanished without closing its connections is
	// detected on an idle connection. Busy connections are guarded by the callers' deadlines.
	KeepAlive time.Duration
	// TLS, when not nil, runs every data connection over TLS, opened before the hello:
	// Server for the connections the listener accepts, Client for those its transports dial.
	// Both must authenticate the peer (mutual TLS; cluster.TLS makes such configurations).
	// The hello still proves the job's secret, inside the encrypted channel. nil: plain TCP.
	TLS *TLS
}

// TLS holds the two ends' TLS configurations of the data plane.
type TLS struct {
	Server, Client *tls.Config
}

// DefaultConfig: 10 s handshakes, dial retries and frame finishing, kernel autotuned socket
// buffers, 15 s keepalive.
func DefaultConfig() Config {
	return Config{
		HandshakeTimeout: 10 * time.Second,
		DialTimeout:      10 * time.Second,
		FinishTimeout:    10 * time.Second,
		SocketBuffer:     0,
		KeepAlive:        15 * time.Second,
	}
}

// maxSocketBuffer bounds Config.SocketBuffer: Linux caps the setting at
// net.core.{r,w}mem_max anyway, and a larger request is a configuration mistake.
const maxSocketBuffer = 256 << 20

// Validate checks the fields; errors name the field and the allowed range.
func (c Config) Validate() error {
	switch {
	case c.HandshakeTimeout < 10*time.Millisecond || c.HandshakeTimeout > 10*time.Minute:
		return fmt.Errorf("handshake_timeout: must be between 10ms and 10m, got %v", c.HandshakeTimeout)
	case c.DialTimeout < 10*time.Millisecond || c.DialTimeout > 10*time.Minute:
		return fmt.Errorf("dial_timeout: must be between 10ms and 10m, got %v", c.DialTimeout)
	case c.FinishTimeout < 10*time.Millisecond || c.FinishTimeout > 10*time.Minute:
		return fmt.Errorf("finish_timeout: must be between 10ms and 10m, got %v", c.FinishTimeout)
	case c.SocketBuffer < 0 || c.SocketBuffer > maxSocketBuffer:
		return fmt.Errorf("socket_buffer: must be between 0 (kernel autotuning) and %d bytes, got %d", maxSocketBuffer, c.SocketBuffer)
	case c.KeepAlive < time.Second || c.KeepAlive > time.Hour:
		return fmt.Errorf("keepalive: must be between 1s and 1h, got %v", c.KeepAlive)
	case c.TLS != nil && (c.TLS.Server == nil || c.TLS.Client == nil):
		return errors.New("tls: needs both a server and a client configuration")
	}
	return nil
}
