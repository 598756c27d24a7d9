package dashboard

import (
	"fmt"

	"github.com/qvd/qvd/internal/httpserve"
)

// Config is the dashboard a training job serves for itself (`qvd train --dashboard-addr`).
type Config struct {
	// Addr is the HOST:PORT rank 0 serves the dashboard on while it trains (port 0: a free
	// one, which the log names); "" serves none. `qvd dashboard RUN_DIR` serves the same
	// page for any run, finished or not, without this.
	Addr string `yaml:"addr" json:"addr"`
}

// DefaultConfig serves no dashboard.
func DefaultConfig() Config { return Config{} }

// Validate checks that Addr is empty or HOST:PORT with a port in 0-65535.
func (c Config) Validate() error {
	if c.Addr == "" {
		return nil
	}
	if _, err := httpserve.CheckAddr(c.Addr); err != nil {
		return fmt.Errorf("addr: %w", err)
	}
	return nil
}
