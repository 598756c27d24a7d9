// Package cudaemu reaches the extra entry points of qvd's emulated CUDA driver, a
// libcuda.so.1 that runs engine/cuda's kernels on the CPU so that the cuda-tagged code runs
// and is tested without a GPU. The emulator itself is C++ beside this file:
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
//
//	include/cuda_emu.h  what kernels.cu needs from nvcc, for g++ (-include): threadIdx and the
//	                    other built-ins, __syncthreads and the warp shuffles as real barriers
//	                    between fibers, __shared__, atomics (std::atomic_ref), the rounded
//	                    intrinsics; half and bfloat16 come from CUDA 11.8's own headers
//	gen/                writes the kernel table from kernels.cu's extern "C" __global__
//	                    signatures: names, __launch_bounds__ and a launcher that unpacks
//	                    cuLaunchKernel's kernelParams by decltype(&kernel), at every build
//	libcuda/            the driver API subset gorgonia.org/cu, engine/cuda, internal/pinned and
//	                    collective/nccl call (symbols.txt lists every one the binary links;
//	                    the rest are stubs that name themselves), the block executor (exec.cc)
//	libcublas/          cublasCreate/Destroy/SetStream/SetMathMode/GemmEx/Sgemm and
//	                    GemmStridedBatchedEx on OpenBLAS
//	libnccl/            the NCCL calls collective/nccl binds, between the ranks of a
//	                    communicator (goroutines on the emulated devices, or processes) over
//	                    a POSIX shared-memory segment named in the unique id, queued on the
//	                    caller's stream (cudaemu_enqueue) and reduced in a fixed rank order
//	Makefile            builds libcuda.so.1, libcublas.so.13 and libnccl.so.2 into build/cudaemu
//
// Use: make -C internal/cudaemu, then run with LD_LIBRARY_PATH=build/cudaemu,
// QVD_CUBLAS_LIBRARY=build/cudaemu/libcublas.so.13 and
// QVD_NCCL_LIBRARY=build/cudaemu/libnccl.so.2 (scripts/gpu/emulate.sh does all of it); a
// group of N ranks in one process needs QVD_CUDAEMU_DEVICES=N. The emulator's knobs are
// environment variables read by the C++ libraries (QVD_CUDAEMU_*: DEVICES, SMS, MEMORY_MIB,
// FILL, DELAY_US, SYNC, QUIET, COVERAGE, GEMM, NCCL_SLOT_KIB; see libcuda/driver.cc,
// libcublas/cublas.cc and libnccl/nccl.cc; docs/gpu.md, "Running the CUDA path without a
// GPU", lists them with what the emulation cannot show).
//
// This package is plain Go (purego, through internal/dynlib) and builds everywhere; Open
// fails with ErrNotEmulated in a process whose libcuda.so.1 is NVIDIA's.
package cudaemu
