package memory

// GPU is one GPU as `qvd gpus` lists it. A figure the GPU or driver does not report (NVML
// answers "not supported" on some boards) is nil.
type GPU struct {
	Index       int      `json:"index"`
	Name        string   `json:"name"`
	UUID        string   `json:"uuid,omitempty"`
	MemoryUsed  uint64   `json:"memory_used_bytes"`
	MemoryTotal uint64   `json:"memory_total_bytes"`
	UtilGPU     *uint32  `json:"utilization_gpu_percent,omitempty"`    // kernels running, over the last sample period
	UtilMemory  *uint32  `json:"utilization_memory_percent,omitempty"` // memory being read or written, likewise
	Temperature *uint32  `json:"temperature_celsius,omitempty"`
	PowerWatts  *float64 `json:"power_watts,omitempty"`
	PowerLimit  *float64 `json:"power_limit_watts,omitempty"`
}

// Inventory is the GPUs of a machine with the driver's versions.
type Inventory struct {
	Driver     string `json:"driver_version,omitempty"`      // "535.104.05"
	CUDADriver string `json:"cuda_driver_version,omitempty"` // the newest CUDA the driver supports, "12.2"
	GPUs       []GPU  `json:"gpus"`
}

// Inventorier is a DeviceSource that can also describe its GPUs in full (NVML's does).
type Inventorier interface {
	Inventory() (Inventory, error)
}
