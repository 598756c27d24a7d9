//go:build cgo

package main

import (
	"encoding/json"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"

	"github.com/qvd/qvd/memory"
)

// mockNVML is go-nvml's mock of a driver with two H100s, the second of which reports no
// power or temperature (as some boards answer "not supported").
func mockNVML(shutdowns *int) *mock.Interface {
	dev := func(i int) *mock.Device {
		d := &mock.Device{
			GetNameFunc: func() (string, nvml.Return) { return "NVIDIA H100 80GB HBM3", nvml.SUCCESS },
			GetUUIDFunc: func() (string, nvml.Return) { return "GPU-0000000" + string(rune('0'+i)), nvml.SUCCESS },
			GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) {
				return nvml.Memory{Total: 80 << 30, Used: uint64(i*40+1) << 29, Free: 80<<30 - uint64(i*40+1)<<29}, nvml.SUCCESS
			},
			GetUtilizationRatesFunc: func() (nvml.Utilization, nvml.Return) {
				return nvml.Utilization{Gpu: uint32(97 * i), Memory: uint32(41 * i)}, nvml.SUCCESS
			},
			GetTemperatureFunc: func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 34, nvml.SUCCESS },
			GetPowerUsageFunc:  func() (uint32, nvml.Return) { return 71_400, nvml.SUCCESS },
			GetEnforcedPowerLimitFunc: func() (uint32, nvml.Return) {
				return 700_000, nvml.SUCCESS
			},
		}
		if i == 1 {
			d.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
			d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }
		}
		return d
	}
	return &mock.Interface{
		InitFunc:                       func() nvml.Return { return nvml.SUCCESS },
		ShutdownFunc:                   func() nvml.Return { *shutdowns++; return nvml.SUCCESS },
		DeviceGetCountFunc:             func() (int, nvml.Return) { return 2, nvml.SUCCESS },
		DeviceGetHandleByIndexFunc:     func(i int) (nvml.Device, nvml.Return) { return dev(i), nvml.SUCCESS },
		SystemGetDriverVersionFunc:     func() (string, nvml.Return) { return "580.65.06", nvml.SUCCESS },
		SystemGetCudaDriverVersionFunc: func() (int, nvml.Return) { return 13000, nvml.SUCCESS },
	}
}

func TestGPUsTableFromNVML(t *testing.T) {
	shutdowns := 0
	open := func() memory.DeviceSource { return memory.OpenNVMLWith(mockNVML(&shutdowns)) }
	code, out, errOut := gpus(open)
	want := "NVIDIA driver 580.65.06, CUDA 13.0\n" +
		"GPU  NAME                   MEMORY USED / TOTAL   GPU UTIL  MEM UTIL  TEMP  POWER\n" +
		"0    NVIDIA H100 80GB HBM3  512.0 MiB / 80.0 GiB  0%        0%        34 C  71 W / 700 W\n" +
		"1    NVIDIA H100 80GB HBM3  20.5 GiB / 80.0 GiB   97%       41%       -     -\n"
	if code != exitOK || out != want || errOut != "" {
		t.Fatalf("exit %d, stderr %q, table\n%s\nwant\n%s", code, errOut, out, want)
	}
	if shutdowns != 1 {
		t.Errorf("NVML shut down %d times", shutdowns)
	}

	code, out, _ = gpus(open, "--json", "--require")
	var rep memory.Inventory
	if err := json.Unmarshal([]byte(out), &rep); err != nil || code != exitOK {
		t.Fatalf("--json: exit %d, %v\n%s", code, err, out)
	}
	g0, g1 := rep.GPUs[0], rep.GPUs[1]
	if rep.Driver != "580.65.06" || rep.CUDADriver != "13.0" || len(rep.GPUs) != 2 ||
		g0.MemoryUsed != 512<<20 || g0.MemoryTotal != 80<<30 || *g0.PowerWatts != 71.4 || *g0.PowerLimit != 700 ||
		*g0.Temperature != 34 || g0.UUID != "GPU-00000000" || *g1.UtilGPU != 97 || *g1.UtilMemory != 41 ||
		g1.Temperature != nil || g1.PowerWatts != nil {
		t.Fatalf("--json:\n%s", out)
	}
}

func TestGPUsNVMLWithoutGPUs(t *testing.T) {
	shutdowns := 0
	lib := mockNVML(&shutdowns)
	lib.InitFunc = func() nvml.Return { return nvml.ERROR_DRIVER_NOT_LOADED }
	code, out, _ := gpus(func() memory.DeviceSource { return memory.OpenNVMLWith(lib) })
	if code != exitOK || out != "No GPU: NVML found but the NVIDIA driver is not loaded\n" {
		t.Fatalf("exit %d: %q", code, out)
	}
}
