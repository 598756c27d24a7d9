// Package pinned is page-locked host memory from the CUDA driver (cuMemAllocHost), the
// staging memory of the CUDA device (engine/cuda) and of the NCCL communicator
// (collective/nccl). The copy engines read and write such memory directly, so an asynchronous
// copy from or to it really is asynchronous; from pageable memory the driver would stage it
// itself and the copy would block.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
// gorgonia.org/cu v0.9.4 can free pinned memory (MemFreeHost) but not allocate it, which is
// why this package calls the driver. It is built only with the cuda tag.
package pinned
