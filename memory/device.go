package memory

import (
	"errors"
	"fmt"
)

// Device is one GPU's memory as the driver reports it.
type Device struct {
	Index             int
	Name              string
	Used, Free, Total uint64 // bytes
}

// DeviceSource reports the GPUs' memory. It is read only when a report is logged.
type DeviceSource interface {
	// Devices returns each GPU's memory, or an error wrapping ErrNoDevice that says why
	// there is none.
	Devices() ([]Device, error)
}

// ErrNoDevice is returned by a DeviceSource on a machine without a usable GPU.
var ErrNoDevice = errors.New("no GPU")

// NoDevices is the DeviceSource of a machine without GPUs; Reason says why
// ("NVML not found (libnvidia-ml.so.1 is not installed)").
type NoDevices struct{ Reason string }

var _ DeviceSource = NoDevices{}

func (n NoDevices) Devices() ([]Device, error) {
	return nil, fmt.Errorf("%w: %s", ErrNoDevice, n.Reason)
}
