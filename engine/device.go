package engine

import (
	"errors"
	"fmt"

	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
	"github.com/qvd/qvd/model"
)

// DType is the element type of a device buffer.
type DType uint8

// Element types. Floating-point buffers hold a model's weights, activations and gradients in
// its working precision; I32 holds labels and max-pool indices.
const (
	F32 DType = iota + 1
	F16
	BF16
	I32
)

func (t DType) String() string {
	switch t {
	case F32:
		return "f32"
	case F16:
		return "f16"
	case BF16:
		return "bf16"
	case I32:
		return "i32"
	}
	return fmt.Sprintf("DType(%d)", uint8(t))
}

// Size is the element size in bytes.
func (t DType) Size() int {
	switch t {
	case F16, BF16:
		return 2
	case F32, I32:
		return 4
	}
	return 0
}

// Float reports whether t is a floating-point type.
func (t DType) Float() bool { return t == F32 || t == F16 || t == BF16 }

// FromFormat is the device type of a working precision.
func FromFormat(f half.Format) DType {
	switch f {
	case half.FP16:
		return F16
	case half.BF16:
		return BF16
	}
	return F32
}

// Format is the working precision of a floating-point type.
func (t DType) Format() half.Format {
	switch t {
	case F16:
		return half.FP16
	case BF16:
		return half.BF16
	}
	return half.FP32
}

// Ptr is the address of an allocation on the device (a CUdeviceptr; an arena handle on the
// host reference device).
type Ptr uint64

// Buf is a typed view of device memory: N elements of type T starting Off elements into the
// allocation at Ptr. Views are values: slicing never allocates, as a parameter tensor is a
// view of the flat parameter buffer on the CPU.
type Buf struct {
	Ptr Ptr
	Off int
	N   int
	T   DType
}

// Slice returns elements [lo, hi) of b.
func (b Buf) Slice(lo, hi int) Buf {
	if lo < 0 || hi < lo || hi > b.N {
		panic(fmt.Sprintf("engine: slice [%d:%d] of a buffer of %d elements", lo, hi, b.N))
	}
	return Buf{Ptr: b.Ptr, Off: b.Off + lo, N: hi - lo, T: b.T}
}

// Bytes is the size of the view in bytes.
func (b Buf) Bytes() int { return b.N * b.T.Size() }

// Addr is the device address of the view's first element.
func (b Buf) Addr() uint64 { return uint64(b.Ptr) + uint64(b.Off*b.T.Size()) }

// Valid reports whether b is a non-empty view of an allocation.
func (b Buf) Valid() bool { return b.Ptr != 0 && b.T != 0 }

// ErrDevice wraps failures reported by the device or its libraries (a failed launch, a
// cuBLAS status, a lost context).
var ErrDevice = errors.New("gpu")

// Device is the seam between the GPU engine and a backend: raw memory, copies, cuBLAS-style
// GEMMs and the handful of kernels a sequential network needs. Every operation is queued on
// the device's compute stream and runs in order; as with CUDA, an operation does not return
// its failure: the first one is kept and returned by Sync (and by Download, which syncs),
// and every operation after it is skipped. The CUDA backend lives in engine/cuda (build tag
// cuda); Host is a reference backend in plain Go with the same semantics, used to test the
// engine on machines without a GPU and to check the CUDA kernels against.
//
// Shapes are row-major. Floating-point operations read their inputs in the buffers' types,
// compute and accumulate in fp32 and round once when they store, as the CUDA kernels and
// cublasGemmEx with CUBLAS_COMPUTE_32F do.
type Device interface {
	// Name describes the device ("NVIDIA H100 80GB HBM3 (sm_90, driver 13.0)").
	Name() string
	// Malloc allocates raw memory for n elements of t. It fails with an error wrapping
	// memory.ErrOutOfMemory when the device is full. Most callers allocate through an
	// Allocator, which caches and accounts.
	Malloc(n int, t DType) (Buf, error)
	// Release frees an allocation made by Malloc (b must be the whole allocation).
	Release(b Buf)
	// TotalMemory is the device's memory in bytes (0 if unknown).
	TotalMemory() uint64

	// Upload copies src into dst (len(src) == dst.N), converting to dst.T (rounding to
	// nearest even). Labels are uploaded with UploadInt32.
	Upload(dst Buf, src []float32)
	UploadInt32(dst Buf, src []int32)
	// Download waits for the queued work and copies src into dst (len(dst) == src.N),
	// converting to float32; it returns the first error of the queue and clears it, as Sync.
	Download(dst []float32, src Buf) error
	// Fill sets every element of b to v.
	Fill(b Buf, v float32)
	// Copy copies src into dst (same length), converting between floating-point types.
	Copy(dst, src Buf)

	// Gemm computes C = alpha·op(A)·op(B) + beta·C for row-major matrices: op(A) is m×k
	// (A is k×m when transA), op(B) is k×n (B is n×k when transB), C is m×n. The leading
	// dimensions are those of contiguous row-major storage. With beta 0, C is not read (as in
	// BLAS: whatever it held, NaN included, does not matter); the same holds for SumRows.
	Gemm(transA, transB bool, m, n, k int, alpha float32, a, b Buf, beta float32, c Buf)

	// GemmLD is Gemm on matrices whose rows lie lda, ldb and ldc elements apart (each at
	// least its stored row length): blocks of rows or columns of larger matrices, such as the
	// part of a weight gradient that falls in one communication bucket. Each view must cover
	// its strided extent, (rows−1)·ld + row length elements.
	GemmLD(transA, transB bool, m, n, k int, alpha float32, a Buf, lda int, b Buf, ldb int, beta float32, c Buf, ldc int)

	// ConvWorkspace is the workspace Conv2D and Conv2DBackward need for shape s: n elements of
	// type t (n 0: none). Each backend computes a convolution its own way (the CPU backend one
	// sample at a time, in cache; the CUDA one as a batch-wide unfolding and GEMM), so each
	// says what it needs, and the engine allocates it where activations are accounted.
	ConvWorkspace(s ConvShape, t DType) (n int, wt DType)
	// Conv2D computes y (N×Out×OH×OW) = x (N×C×H×W) ⋆ w (Out×C×K×K) + bias (Out): a stride-1
	// convolution with Pad zeros on every side (PyTorch's Conv2d, NCHW).
	Conv2D(y, x, w, bias, ws Buf, s ConvShape)
	// Conv2DBackward computes, from dy (N×Out×OH×OW) and the forward pass's x and w, the
	// weight and bias gradients into dw = beta·dw + ∂L/∂w and db = beta·db + ∂L/∂b (either may
	// be an invalid Buf: a frozen tensor) and, if dx is Valid, the input gradient dx.
	Conv2DBackward(dx, dw, db, dy, x, w, ws Buf, s ConvShape, beta float32)

	// AddBias adds bias to a rows×cols matrix y: bias[c] to every row when perRow is false,
	// bias[r] to every element of row r when perRow is true (a convolution's bias over the
	// channel-major layout).
	AddBias(y, bias Buf, rows, cols int, perRow bool)
	// SumRows sets dst[c] = beta·dst[c] + Σ_r src[r, c] (perRow false), or dst[r] =
	// beta·dst[r] + Σ_c src[r, c] (perRow true): the bias gradients.
	SumRows(dst, src Buf, rows, cols int, perRow bool, beta float32)
	// ReLU sets y = max(x, 0) (y and x may be the same buffer).
	ReLU(y, x Buf)
	// ReLUGrad sets dx = dy where y > 0 and 0 elsewhere (dx and dy may be the same buffer).
	ReLUGrad(dx, dy, y Buf)
	// Transpose01 swaps the first two axes of an a×b×r array: dst[j, i, :] = src[i, j, :].
	Transpose01(dst, src Buf, a, b, r int)
	// Im2Col unfolds x (n×c×h×w) for a k×k convolution with padding pad and stride 1 into
	// cols ((c·k·k) × (n·oh·ow)), oh = h+2·pad-k+1: column j holds the receptive field of
	// output pixel j (sample-major), so the convolution is one GEMM.
	Im2Col(cols, x Buf, n, c, h, w, k, pad int)
	// Col2Im is Im2Col's adjoint: dx (n×c×h×w) = Σ of the columns' entries that read each
	// input element (overwriting dx).
	Col2Im(dx, cols Buf, n, c, h, w, k, pad int)
	// MaxPool2 is a 2×2, stride-2 max-pool of x (planes × h × w, planes = n·c) into y
	// (planes × h/2 × w/2); idx (I32, len y.N) records the flat index into x of each maximum.
	MaxPool2(y, idx, x Buf, planes, h, w int)
	// MaxPool2Grad routes dy back to the maxima: dx is zeroed, then dx[idx[i]] = dy[i].
	MaxPool2Grad(dx, dy, idx Buf)
	// SoftmaxXent computes, for logits (rows × classes) and labels (I32, rows), each row's
	// cross-entropy into loss (F32, rows) and dlogits = (softmax − onehot)·scale (dlogits may
	// alias logits).
	SoftmaxXent(dlogits, loss, logits, labels Buf, rows, classes int, scale float32)
	// GemmBatched is batch GemmLD calls at once (cublasGemmStridedBatchedEx): the i-th
	// multiplies the matrices starting i·strideA, i·strideB and i·strideC elements into a, b
	// and c. Multi-head attention runs one per head over the micro-batch. A stride may be 0
	// (every GEMM reads the same matrix); the C matrices must not share an element (heads
	// side by side, strideC = head width with ldc = the row, are fine).
	GemmBatched(transA, transB bool, m, n, k int, alpha float32, a Buf, lda, strideA int, b Buf, ldb, strideB int, beta float32, c Buf, ldc, strideC int, batch int)
	// The transformer operations below take every floating-point buffer of a call in one
	// type, except CopyRows (which converts) and the F32 statistics (mean, rstd).
	//
	// Axpby sets y = a·x + b·y elementwise (same length; x may be y): the residual add
	// (a = b = 1) and scaling (a mean pool's 1/n). With b 0, y is not read (as Gemm's beta).
	Axpby(y, x Buf, a, b float32)
	// CopyRows copies a rows×cols block: dst[r·ldDst + c] = src[r·ldSrc + c], converting
	// between floating-point types. ldSrc 0 repeats src's first row in every row (the class
	// token broadcast over the batch). The views must cover their strided extents.
	CopyRows(dst Buf, ldDst int, src Buf, ldSrc int, rows, cols int)
	// LayerNorm normalises each row of x (rows × cols) over its cols elements, as
	// torch.nn.LayerNorm: y = (x − μ)·rstd·gamma + beta, with μ the row's mean and rstd =
	// 1/sqrt(σ² + eps), σ² the biased variance; gamma and beta have cols elements. It stores
	// μ and rstd (F32, rows each) for the backward pass. y may alias x only if the backward
	// pass will not need x: the engine never aliases them.
	LayerNorm(y, mean, rstd, x, gamma, beta Buf, rows, cols int, eps float32)
	// LayerNormBackward takes dy and the forward's x, mean, rstd and gamma and sets dgamma =
	// b·dgamma + Σ_rows dy·x̂ and dbeta = b·dbeta + Σ_rows dy (x̂ = (x − μ)·rstd; either
	// gradient may be an invalid Buf: frozen; with b 0 they are not read) and, if dx is
	// Valid, the input gradient dx (dx may alias dy).
	LayerNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma Buf, rows, cols int, b float32)
	// GELU sets y = x·Φ(x), Φ the standard normal CDF (the exact erf form, torch.nn.GELU()'s
	// default). y must not alias x: the backward pass reads x.
	GELU(y, x Buf)
	// GELUGrad sets dx = dy·(Φ(x) + x·φ(x)) (dx may alias dy).
	GELUGrad(dx, dy, x Buf)
	// Dropout sets y = x/(1−p) where DropoutKeep(seed, i, p) and exactly 0 elsewhere, i the
	// element's index in the view, p in [0, 1] (y may alias x). The mask is a function of (seed, i), so the backward
	// pass is Dropout on dy with the same seed, and every backend draws the same mask.
	Dropout(y, x Buf, p float32, seed uint64)
	// Softmax sets each row of y (rows × cols) to softmax(scale·x) over the row, computed in
	// fp32 whatever the buffers' type (y may alias x).
	Softmax(y, x Buf, rows, cols int, scale float32)
	// SoftmaxGrad is Softmax's backward pass from its output y: dx = scale·y⊙(dy − Σ_c dy⊙y)
	// per row (dx may alias dy).
	SoftmaxGrad(dx, dy, y Buf, rows, cols int, scale float32)
	// Patchify cuts x (n×c×h×w, h and w multiples of p) into non-overlapping p×p patches:
	// cols is (n·(h/p)·(w/p)) × (c·p·p), row t of a sample its t-th patch in raster order, the
	// patch's pixels in (channel, row, column) order, which is a Conv2d weight's [out, c, p, p]
	// order: a stride-p convolution (a ViT's patch embedding) is then one GEMM.
	Patchify(cols, x Buf, n, c, h, w, p int)
	// Unpatchify is Patchify's adjoint (its inverse: the patches do not overlap): it writes
	// every element of dx.
	Unpatchify(dx, cols Buf, n, c, h, w, p int)
	// BatchNorm normalises x (n×c×hw, NCHW) per channel, as torch.nn.BatchNorm2d. Training
	// (train true): μ and σ² (biased) over the n·hw elements of each channel, stored as mean
	// and rstd = 1/sqrt(σ² + eps) (F32, c each) for the backward pass and the running
	// statistics. Evaluation (train false): mean and rstd are inputs (from the running
	// statistics). Then y = (x − μ)·rstd·gamma + beta (y may alias x only in evaluation).
	BatchNorm(y, mean, rstd, x, gamma, beta Buf, n, c, hw int, eps float32, train bool)
	// BatchNormBackward is the training-mode backward pass: dgamma = b·dgamma + Σ dy·x̂,
	// dbeta = b·dbeta + Σ dy per channel (either may be invalid: frozen; with b 0 they are
	// not read) and, if dx is Valid, dx (may alias dy).
	BatchNormBackward(dx, dgamma, dbeta, dy, x, mean, rstd, gamma Buf, n, c, hw int, b float32)
	// AdamW is the fused optimizer step on fp32 master weights p with fp32 moments m and v
	// for gradient g (any float type), with vec.AdamW's arithmetic (every operation rounded
	// to float32, no fused multiply-add: the same bits as the CPU optimizer), then stores the
	// updated weights rounded to the working precision into w (skipped when w is not Valid).
	AdamW(p, m, v, g, w Buf, c vec.AdamConsts)
	// UnscaleCheck multiplies g by s in place and sets found (F32, one element) to 1 if any
	// element of g is Inf or NaN (it never clears found): the loss scaler's check in one pass.
	UnscaleCheck(g, found Buf, s float32)
	// SumSquares adds Σ g² into acc (F32, one element): the global norm for clipping. How the
	// partial sums are kept is the backend's (fp32 per block on CUDA, fp64 per chunk on the
	// CPU); a non-finite element makes acc non-finite.
	SumSquares(acc, g Buf)

	// Sync waits for the queued work and returns the first error since the last Sync.
	Sync() error
	// Close releases the device's context, streams and libraries.
	Close() error
}

// DropoutKeep reports whether element i survives a dropout of probability p drawn with seed
// (model.DropoutKeep: a SplitMix64 hash of (seed, i) compared, as a 24-bit fraction, with p).
// Every backend computes this same function (the CUDA kernel in 64-bit integer arithmetic),
// so a mask is identical on every device, every rank and after a resume.
func DropoutKeep(seed, i uint64, p float32) bool { return model.DropoutKeep(seed, i, p) }
