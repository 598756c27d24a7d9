// Package gpu is qvd's GPU engine: a model.Spec executed on a Device (flat device buffers,
// GEMMs, a handful of kernels), a caching device allocator with the accounting the memory
// monitor reports, and the device-side optimizer and loss-scaling kernels.
//
// The engine is written against the Device interface, so it runs on two backends: the CUDA
// one in gpu/cuda (build tag cuda: gorgonia.org/cu for the driver API, cuBLAS and NCCL loaded
// at run time) and Host, a plain-Go reference with the same semantics. On machines without a
// GPU the engine's tests run over Host and compare it with the gorgonia engine; on a GPU the
// same comparisons run over CUDA.
package gpu
