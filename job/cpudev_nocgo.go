//go:build !cgo

package job

import (
	"errors"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/offload"
)

// CPUDevice: the CPU backend is C (OpenBLAS and its kernels) and needs cgo.
func CPUDevice(pool *offload.Pool, threads int, limit uint64) (engine.Device, error) {
	return nil, errors.New("device.type: cpu: this qvd was built without cgo, which the CPU backend (OpenBLAS) needs; build it with cgo, or train with engine: gorgonia (pure Go)")
}
