//go:build cgo

package memory

import (
	"fmt"
	"os"
	"path/filepath"
	"sync"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// OpenNVML returns the GPUs' memory through NVML (libnvidia-ml, loaded at run time), or
// NoDevices saying why not — no driver, no GPU — so a machine without one needs nothing.
// Close the result (it implements io.Closer when NVML started) to shut NVML down.
func OpenNVML() DeviceSource {
	if !driverPresent() {
		return NoDevices{Reason: "no NVIDIA driver on this machine (no /proc/driver/nvidia, no /dev/nvidia*): NVML not loaded"}
	}
	return openNVML(nvml.New())
}

// driverPresent reports whether an NVIDIA kernel driver is visible: its /proc entry, or a
// device node (a container given GPUs sees those). Loading libnvidia-ml costs about 12 MiB
// of resident memory even where it then finds no driver, so a CPU machine never loads it.
func driverPresent() bool {
	if _, err := os.Stat("/proc/driver/nvidia/version"); err == nil {
		return true
	}
	nodes, _ := filepath.Glob("/dev/nvidia[0-9]*")
	return len(nodes) > 0
}

// nvmlSource reads the memory of count devices; the library stays initialised until Close.
type nvmlSource struct {
	lib   nvml.Interface
	count int
	once  sync.Once
}

func openNVML(lib nvml.Interface) DeviceSource {
	switch ret := lib.Init(); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		return NoDevices{Reason: "NVML not found (libnvidia-ml.so.1 could not be loaded: no NVIDIA driver on this machine)"}
	case nvml.ERROR_DRIVER_NOT_LOADED:
		return NoDevices{Reason: "NVML found but the NVIDIA driver is not loaded"}
	default:
		return NoDevices{Reason: "NVML did not start: " + ret.Error()}
	}
	n, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS || n == 0 {
		lib.Shutdown()
		if ret != nvml.SUCCESS {
			return NoDevices{Reason: "NVML could not count the GPUs: " + ret.Error()}
		}
		return NoDevices{Reason: "NVML found no GPU"}
	}
	return &nvmlSource{lib: lib, count: n}
}

func (s *nvmlSource) Devices() ([]Device, error) {
	out := make([]Device, 0, s.count)
	for i := 0; i < s.count; i++ {
		d, ret := s.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return out, fmt.Errorf("NVML: GPU %d: %s", i, ret.Error())
		}
		mem, ret := d.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return out, fmt.Errorf("NVML: memory of GPU %d: %s", i, ret.Error())
		}
		name, ret := d.GetName()
		if ret != nvml.SUCCESS {
			name = ""
		}
		out = append(out, Device{Index: i, Name: name, Used: mem.Used, Free: mem.Free, Total: mem.Total})
	}
	return out, nil
}

// Close shuts NVML down; safe to call twice.
func (s *nvmlSource) Close() error {
	var err error
	s.once.Do(func() {
		if ret := s.lib.Shutdown(); ret != nvml.SUCCESS {
			err = fmt.Errorf("NVML shutdown: %s", ret.Error())
		}
	})
	return err
}
