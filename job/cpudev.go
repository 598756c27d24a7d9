//go:build cgo

package job

import (
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cpu"
	"github.com/qvd/qvd/offload"
)

// CPUDevice opens the CPU backend (engine/cpu: OpenBLAS and C kernels, so cgo) on pool
// (nil: its own with threads goroutines), its allocations capped at limit bytes (0: none).
func CPUDevice(pool *offload.Pool, threads int, limit uint64) (engine.Device, error) {
	return cpu.New(cpu.Options{Pool: pool, Threads: threads, Limit: limit}), nil
}
