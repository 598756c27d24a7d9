package promexport

import (
	"fmt"
	"net"
	"strconv"

	"github.com/qvd/qvd/internal/httpserve"
)

// Config is the metrics endpoint. YAML under `monitoring:`.
type Config struct {
	// MetricsAddr is the HOST:PORT the job's ranks serve /metrics on: rank r listens on
	// PORT+r, and PORT 0 makes every rank pick a free port (logged at start). "" serves
	// nothing (the default). A worker's own `qvd join --metrics-addr` is used as given.
	MetricsAddr string `yaml:"metrics_addr" json:"metrics_addr"`
}

// DefaultConfig serves no metrics.
func DefaultConfig() Config { return Config{} }

// Validate checks the fields; errors name the field.
func (c Config) Validate() error {
	if c.MetricsAddr == "" {
		return nil
	}
	if _, err := httpserve.CheckAddr(c.MetricsAddr); err != nil {
		return fmt.Errorf("metrics_addr: %w", err)
	}
	return nil
}

// maxPort is the largest TCP port.
const maxPort = 65535

// RankAddr is where rank serves its metrics for a job whose metrics_addr is base: the port
// plus the rank, or port 0 (a free port) for every rank. It is an error if the rank's port
// would pass 65535.
func RankAddr(base string, rank int) (string, error) {
	port, err := httpserve.CheckAddr(base)
	if err != nil {
		return "", fmt.Errorf("metrics_addr: %w", err)
	}
	if rank < 0 {
		return "", fmt.Errorf("metrics_addr: rank %d is negative", rank)
	}
	if port == 0 {
		return base, nil
	}
	if port+rank > maxPort {
		return "", fmt.Errorf("metrics_addr: rank %d would listen on port %d+%d, past %d: choose a lower port, or port 0", rank, port, rank, maxPort)
	}
	host, _, _ := net.SplitHostPort(base)
	return net.JoinHostPort(host, strconv.Itoa(port+rank)), nil
}
