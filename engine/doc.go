// Package engine is qvd's compute engine: a model.Spec executed layer by layer on a Device
// (flat buffers, GEMMs, a handful of kernels), a caching allocator with the accounting the
// memory monitor reports, and the device-side optimizer and loss-scaling kernels.
// It must not import trainer, configs, job or cmd (docs/architecture.md): the trainer drives
// the engine through its own interfaces.
//
// The engine is written against the Device interface, so one engine runs on every backend:
// cpu (engine/cpu: OpenBLAS GEMMs and vectorised kernels over memory outside the Go heap; the
// default), cuda (engine/cuda, build tag cuda: gorgonia.org/cu for the driver API, cuBLAS and
// NCCL loaded at run time) and reference (Reference, plain Go, one operation at a time, the
// semantics every backend is checked against). gorgonia's graphs (package model) are the
// independent oracle: every layer's forward and backward is tested against gorgonia's
// symbolic differentiation and finite differences.
package engine
