//go:build !cgo

package main

import (
	"errors"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/offload"
)

// newCPUDevice: the CPU backend is C (OpenBLAS and its kernels) and needs cgo.
func newCPUDevice(pool *offload.Pool, threads int, limit uint64) (engine.Device, error) {
	return nil, errors.New("device.type: cpu: this qvd was built without cgo, which the CPU backend (OpenBLAS) needs; build it with cgo, or train with engine: gorgonia (pure Go)")
}
