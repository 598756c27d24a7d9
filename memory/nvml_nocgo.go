//go:build !cgo

package memory

// OpenNVML needs cgo (go-nvml loads libnvidia-ml through it); without it there are no GPU
// figures.
func OpenNVML() DeviceSource {
	return NoDevices{Reason: "NVML not available (qvd was built without cgo)"}
}
