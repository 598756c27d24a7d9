//go:build cgo

package memory

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// OpenNVMLWith is OpenNVML over the given NVML binding: go-nvml's mock (pkg/nvml/mock) in
// tests of code that lists GPUs.
func OpenNVMLWith(lib nvml.Interface) DeviceSource { return openNVML(lib) }

var _ Inventorier = (*nvmlSource)(nil)

// Inventory describes every GPU NVML sees. Failing to read a GPU's handle, name or memory is
// an error; utilisation, temperature, power and the UUID are left out where NVML cannot give
// them.
func (s *nvmlSource) Inventory() (Inventory, error) {
	var inv Inventory
	if v, ret := s.lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		inv.Driver = v
	}
	if v, ret := s.lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS && v > 0 {
		inv.CUDADriver = fmt.Sprintf("%d.%d", v/1000, v%1000/10)
	}
	inv.GPUs = make([]GPU, 0, s.count)
	for i := 0; i < s.count; i++ {
		d, ret := s.lib.DeviceGetHandleByIndex(i)
		if ret != nvml.SUCCESS {
			return inv, fmt.Errorf("NVML: GPU %d: %s", i, ret.Error())
		}
		g := GPU{Index: i}
		if g.Name, ret = d.GetName(); ret != nvml.SUCCESS {
			return inv, fmt.Errorf("NVML: name of GPU %d: %s", i, ret.Error())
		}
		mem, ret := d.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return inv, fmt.Errorf("NVML: memory of GPU %d: %s", i, ret.Error())
		}
		g.MemoryUsed, g.MemoryTotal = mem.Used, mem.Total
		if uuid, ret := d.GetUUID(); ret == nvml.SUCCESS {
			g.UUID = uuid
		}
		if u, ret := d.GetUtilizationRates(); ret == nvml.SUCCESS {
			g.UtilGPU, g.UtilMemory = &u.Gpu, &u.Memory
		}
		if t, ret := d.GetTemperature(nvml.TEMPERATURE_GPU); ret == nvml.SUCCESS {
			g.Temperature = &t
		}
		if mw, ret := d.GetPowerUsage(); ret == nvml.SUCCESS {
			w := float64(mw) / 1000
			g.PowerWatts = &w
		}
		if mw, ret := d.GetEnforcedPowerLimit(); ret == nvml.SUCCESS {
			w := float64(mw) / 1000
			g.PowerLimit = &w
		}
		inv.GPUs = append(inv.GPUs, g)
	}
	return inv, nil
}
