// Package cuda is the CUDA backend of engine.Device: a Device owns one GPU's primary context, a
// compute stream on which every operation is queued in order, the kernels of engine/cuda/kernels
// (PTX, JIT-compiled by the driver at Open) and a cuBLAS handle bound to that stream for the
// GEMMs.
// It must not import trainer, configs, job or cmd (docs/architecture.md): the trainer drives
// the engine through its own interfaces.
//
// Everything but this file is built only with the build tag cuda (go build -tags cuda):
// gorgonia.org/cu links libcuda and its package initialisation calls cuInit and exits the
// process when there is no GPU, so a default build must not import it. Test binaries of this
// package therefore run only on a GPU machine; CI vets and builds them with -tags cuda.
//
// cuBLAS is not linked: it is loaded at Open with internal/dynlib (libcublas.so.13, .12, .11,
// the pip wheels' copies, or $QVD_CUBLAS_LIBRARY), so one binary built against CUDA 11.8
// headers runs beside whatever CUDA the GPU machine's driver brings.
//
// Linking the package (a blank import in a cuda-tagged file of the binary) registers the
// backend as device.type cuda with engine.Register; Open and Count are also exported for direct
// use, with the accessors another CUDA library needs (Stream, StreamHandle, Context, Do).
//
// The driver's context is per OS thread, so every method pins its goroutine to its thread
// and makes the device's context current for the duration of the call; a Device may be used
// from any goroutine, its methods serialised by a mutex. Do runs other code (an NCCL call on
// Stream) the same way.
package cuda
