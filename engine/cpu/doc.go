// Package cpu is the engine's CPU backend, the one qvd trains with by default.
// It must not import trainer, configs, job or cmd (docs/architecture.md): the trainer drives
// the engine through its own interfaces.
//
// Buffers live outside the Go heap (internal/arena blocks) or are views of the caller's
// memory: on the CPU the host is the device, so the trainer's parameters and the ZeRO
// engine's gradient buckets are computed into in place, with no copies. GEMMs are OpenBLAS's
// sgemm with one thread per call, run in parallel over blocks of the product by the pool of
// goroutines the optimizer also uses (offload.Pool): one set of threads owns the cores, and
// OpenBLAS's own threads never compete with Go's. Convolutions run one sample at a time, each
// unfolded in cache and multiplied straight into its NCHW output (conv.go). On a CPU with
// AVX-512F the convolutions' products, and the dense layers' where k is between 32 and 1024,
// run on qvd's own register-blocked kernels (gemm512.c), which use the AVX-512 units whatever
// kernels OPENBLAS_CORETYPE pins OpenBLAS to (2-3× OpenBLAS's AVX2 ones on the shipped CNN's
// and MLP's shapes; QVD_GEMM=blas turns them off). Without AVX-512F, AVX2 counterparts
// (gemm256.c) take the dense products whose sides stay below 1024, where OpenBLAS's packing
// costs more than it saves. The element-wise
// kernels are C compiled for AVX-512, AVX2 and baseline x86-64 (kernels.c, picked at load
// time). fp16 and bf16 buffers hold 2-byte words; operations compute in fp32 and round once
// when they store, as the CUDA backend does (half.go).
//
// Results do not depend on the number of threads: every pass cuts its work by the shape
// alone, and partial sums are added in a fixed order.
package cpu
