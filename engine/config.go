package engine

import (
	"fmt"
	"sort"
	"strings"
	"sync"
)

// Config selects the engine a worker trains with. YAML `device:`.
type Config struct {
	// Type is "cpu" (the CPU backend, engine/cpu; the default), "cuda" (an NVIDIA GPU: a qvd
	// built with -tags cuda) or "reference" (the plain-Go reference device: slow, for
	// checking the engine).
	Type string `yaml:"type" json:"type"`
	// Ordinal is the GPU to use; -1 (the default) picks local rank modulo the GPU count, as
	// torchrun's LOCAL_RANK convention does.
	Ordinal int `yaml:"ordinal" json:"ordinal"`
}

// DefaultConfig trains on the CPU.
func DefaultConfig() Config { return Config{Type: "cpu", Ordinal: -1} }

// Validate checks the fields; errors name the field.
func (c Config) Validate() error {
	switch c.Type {
	case "cpu", "cuda", "reference":
	default:
		return fmt.Errorf("type: must be cpu, cuda or reference, got %q", c.Type)
	}
	if c.Ordinal < -1 {
		return fmt.Errorf("ordinal: must be -1 (local rank) or a GPU index, got %d", c.Ordinal)
	}
	return nil
}

// GPU reports whether the config selects a device apart from the host's memory (engine.Open
// opens it; the CPU backend is built by its package).
func (c Config) GPU() bool { return c.Type == "cuda" || c.Type == "reference" }

// Opener opens a backend's device number ordinal (already resolved from the local rank).
type Opener func(ordinal int) (Device, error)

// Counter counts a backend's devices.
type Counter func() (int, error)

var (
	backendsMu sync.Mutex
	backends   = map[string]backend{
		"reference": {open: func(int) (Device, error) { return NewReference(), nil }, count: func() (int, error) { return 1, nil }},
	}
)

type backend struct {
	open  Opener
	count Counter
}

// Register makes a backend available to Open; the CUDA backend registers itself when a
// binary built with -tags cuda links engine/cuda.
func Register(name string, open Opener, count Counter) {
	backendsMu.Lock()
	defer backendsMu.Unlock()
	backends[name] = backend{open, count}
}

// Open opens the device c selects for the worker of the given local rank.
func Open(c Config, localRank int) (Device, error) {
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("device.%w", err)
	}
	backendsMu.Lock()
	b, ok := backends[c.Type]
	var names []string
	for n := range backends {
		names = append(names, n)
	}
	backendsMu.Unlock()
	if !ok {
		sort.Strings(names)
		if c.Type == "cuda" {
			return nil, fmt.Errorf("device.type: cuda: this qvd was built without CUDA support (build it with `go build -tags cuda ./cmd/qvd`, which needs the CUDA headers; see docs/gpu.md); backends here: %s", strings.Join(names, ", "))
		}
		return nil, fmt.Errorf("device.type: %s: no such backend here (have %s)", c.Type, strings.Join(names, ", "))
	}
	ord := c.Ordinal
	if ord < 0 {
		n, err := b.count()
		if err != nil {
			return nil, fmt.Errorf("device: counting %s devices: %w", c.Type, err)
		}
		if n < 1 {
			return nil, fmt.Errorf("device: no %s device found", c.Type)
		}
		ord = localRank % n
	}
	d, err := b.open(ord)
	if err != nil {
		return nil, fmt.Errorf("device: opening %s device %d: %w", c.Type, ord, err)
	}
	return d, nil
}
