//go:build cuda

package cuda

import (
	"errors"
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cuda/kernels"
	"github.com/qvd/qvd/internal/pinned"
	"github.com/qvd/qvd/memory"
)

// Device is a engine.Device on one CUDA GPU.
type Device struct {
	mu sync.Mutex

	ordinal int
	dev     cu.Device
	ctx     cu.CUContext // the device's primary context, shared with the CUDA runtime (cuBLAS, NCCL)
	stream  cu.Stream    // the compute stream: every operation, copy and GEMM
	copy    cu.Stream    // UploadAsync's stream
	mod     cu.Module
	kern    map[kernelKey]cu.Function
	blas    *cublas

	name      string
	total     uint64
	maxBlocks int // grid-stride launches use at most this many blocks

	stage     stager // Upload and Download
	copyStage stager // UploadAsync
	// DownloadAsync's pinned memory and the copies WaitDownloads converts from it.
	dlStage    pinned.Buffer
	dlUsed     int
	dlPending  []pendingDownload
	computeEv  cu.Event // marks the compute stream's queue for the copy stream to wait on
	copyDoneEv cu.Event // marks the copy stream's queue for WaitUploads

	// live maps each allocation of Malloc not yet released to its size in bytes: every
	// operation checks its views against it before it queues anything, as a kernel given a
	// freed or foreign address faults, and a fault loses the context for good.
	live map[engine.Ptr]int64
	// report is the kernels' failure report (readReport); reportCheck is set while a kernel
	// that may write it has been queued since it was last read.
	report      cu.DevicePtr
	reportCheck bool

	err    error // the first failure since the last Sync; operations are skipped while set
	closed bool
}

var _ engine.Device = (*Device)(nil)

// errClosed is latched by operations on a closed Device.
var errClosed = errors.New("device is closed")

// Open makes a Device on GPU ordinal: it retains the GPU's primary context, creates the
// compute and copy streams, loads the kernels (the driver JIT-compiles kernels.PTX, or takes
// it from its cache) and a cuBLAS handle on the compute stream.
func Open(ordinal int) (*Device, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	n, err := cu.NumDevices()
	if err != nil {
		return nil, fmt.Errorf("%w: counting CUDA devices: %w", engine.ErrDevice, err)
	}
	if ordinal < 0 || ordinal >= n {
		return nil, fmt.Errorf("%w: no CUDA device %d (this machine has %d)", engine.ErrDevice, ordinal, n)
	}
	dev, err := cu.GetDevice(ordinal)
	if err != nil {
		return nil, fmt.Errorf("%w: cuDeviceGet(%d): %w", engine.ErrDevice, ordinal, err)
	}
	ctx, err := dev.RetainPrimaryCtx()
	if err != nil {
		return nil, fmt.Errorf("%w: retaining the primary context of device %d: %w", engine.ErrDevice, ordinal, err)
	}
	d := &Device{ordinal: ordinal, dev: dev, ctx: ctx, live: map[engine.Ptr]int64{}}
	if err := d.open(); err != nil {
		d.release()
		return nil, fmt.Errorf("%w: opening device %d: %w", engine.ErrDevice, ordinal, err)
	}
	return d, nil
}

// open does Open's work once the primary context is retained; release undoes what it did.
func (d *Device) open() error {
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		return fmt.Errorf("cuCtxSetCurrent: %w", err)
	}
	name, err := d.dev.Name()
	if err != nil {
		return fmt.Errorf("cuDeviceGetName: %w", err)
	}
	major, minor, err := d.dev.ComputeCapability()
	if err != nil {
		return err
	}
	if major < 8 {
		return fmt.Errorf("%s is sm_%d%d; the kernels need sm_80 or newer (bfloat16)", name, major, minor)
	}
	v := cu.Version()
	d.name = fmt.Sprintf("%s (sm_%d%d, driver %d.%d)", name, major, minor, v/1000, v%1000/10)
	total, err := d.dev.TotalMem()
	if err != nil {
		return fmt.Errorf("cuDeviceTotalMem: %w", err)
	}
	d.total = uint64(total)
	sms, err := d.dev.Attribute(cu.MultiprocessorCount)
	if err != nil {
		return fmt.Errorf("cuDeviceGetAttribute(multiprocessor count): %w", err)
	}
	d.maxBlocks = max(sms, 1) * 32

	// Non-blocking: work that a library queues on the legacy default stream does not
	// serialise with the compute stream.
	if d.stream, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return fmt.Errorf("cuStreamCreate: %w", err)
	}
	if d.copy, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return fmt.Errorf("cuStreamCreate: %w", err)
	}
	for _, ev := range []*cu.Event{&d.computeEv, &d.copyDoneEv} {
		if *ev, err = cu.MakeEvent(cu.DisableTiming); err != nil {
			return fmt.Errorf("cuEventCreate: %w", err)
		}
	}
	if err := d.stage.init(); err != nil {
		return err
	}
	if err := d.copyStage.init(); err != nil {
		return err
	}

	if d.mod, err = cu.LoadData(kernels.PTX); err != nil {
		return fmt.Errorf("loading the kernels (PTX made from kernels.cu sha256 %.12s): cuModuleLoadData: %w: %s",
			kernels.SourceSHA256, err, jitLog(kernels.PTX))
	}
	if err := d.loadKernels(); err != nil {
		return err
	}
	if d.report, err = cu.MemAlloc(reportBytes); err != nil {
		return fmt.Errorf("cuMemAlloc: %w", err)
	}
	if err := cu.MemsetD8Async(d.report, 0, reportBytes, d.stream); err != nil {
		return fmt.Errorf("cuMemsetD8Async: %w", err)
	}
	d.blas, err = openCuBLAS(d.StreamHandle())
	return err
}

// release frees what open made, in reverse order, and the primary context; it returns the
// first failure.
func (d *Device) release() error {
	var errs []error
	keep := func(what string, err error) {
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", what, err))
		}
	}
	keep("cuCtxSetCurrent", cu.SetCurrentContext(d.ctx))
	if d.stream != (cu.Stream{}) {
		keep("cuStreamSynchronize", d.stream.Synchronize())
	}
	if d.copy != (cu.Stream{}) {
		keep("cuStreamSynchronize", d.copy.Synchronize())
	}
	keep("cublasDestroy", d.blas.close())
	d.blas = nil
	if d.mod != (cu.Module{}) {
		keep("cuModuleUnload", d.mod.Unload())
		d.mod, d.kern = cu.Module{}, nil
	}
	if d.report != 0 {
		keep("cuMemFree", cu.MemFree(d.report))
		d.report = 0
	}
	d.stage.free()
	d.copyStage.free()
	d.dlStage.Free()
	for _, ev := range []*cu.Event{&d.computeEv, &d.copyDoneEv} {
		if *ev != (cu.Event{}) {
			keep("cuEventDestroy", cu.DestroyEvent(ev))
		}
	}
	for _, s := range []*cu.Stream{&d.stream, &d.copy} {
		if *s != (cu.Stream{}) {
			keep("cuStreamDestroy", s.Destroy())
		}
	}
	keep("cuDevicePrimaryCtxRelease", d.dev.ReleasePrimaryCtx())
	return errors.Join(errs...)
}

// Close waits for the queued work and releases the streams, the kernels, cuBLAS and the
// primary context. Operations after Close fail (latched) with "device is closed".
func (d *Device) Close() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	d.closed = true
	if err := d.release(); err != nil {
		return fmt.Errorf("%w: closing device %d: %w", engine.ErrDevice, d.ordinal, err)
	}
	return nil
}

// Name describes the device: "NVIDIA H100 80GB HBM3 (sm_90, driver 13.0)".
func (d *Device) Name() string { return d.name }

// TotalMemory is the GPU's memory in bytes.
func (d *Device) TotalMemory() uint64 { return d.total }

// Ordinal is the device's CUDA ordinal.
func (d *Device) Ordinal() int { return d.ordinal }

// Context is the device's (primary) context. Use Do to make it current.
func (d *Device) Context() cu.CUContext { return d.ctx }

// Stream is the compute stream, on which every operation of d is queued: a library that
// queues its own work there (an NCCL collective) is ordered with d's operations.
func (d *Device) Stream() cu.Stream { return d.stream }

// StreamHandle is Stream as the raw CUstream (cudaStream_t) that C libraries loaded with
// purego take.
func (d *Device) StreamHandle() uintptr { return uintptr(unsafe.Pointer(d.stream.C())) }

// CopyStream is the stream UploadAsync copies on.
func (d *Device) CopyStream() cu.Stream { return d.copy }

// Do runs fn on an OS thread on which d's context is current, as driver and runtime calls
// about d's memory and streams need (an NCCL call on Stream, say). It does not hold d's lock,
// so fn may call d's methods; it returns fn's error.
func (d *Device) Do(fn func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		return fmt.Errorf("%w: cuCtxSetCurrent: %w", engine.ErrDevice, err)
	}
	return fn()
}

// MemInfo is cuMemGetInfo: the free and total memory of the device in bytes.
func (d *Device) MemInfo() (free, total uint64, err error) {
	if err := d.enter(); err != nil {
		d.exit()
		return 0, 0, err
	}
	defer d.exit()
	f, t, err := cu.MemInfo()
	if err != nil {
		return 0, 0, fmt.Errorf("%w: cuMemGetInfo: %w", engine.ErrDevice, err)
	}
	return uint64(f), uint64(t), nil
}

// enter locks d and pins the calling goroutine to its OS thread with d's context current,
// as every driver and cuBLAS call needs. exit undoes it, whatever enter returned.
func (d *Device) enter() error {
	d.mu.Lock()
	runtime.LockOSThread()
	if d.closed {
		return fmt.Errorf("%w: device %d: %w", engine.ErrDevice, d.ordinal, errClosed)
	}
	if err := cu.SetCurrentContext(d.ctx); err != nil {
		return fmt.Errorf("%w: cuCtxSetCurrent: %w", engine.ErrDevice, err)
	}
	return nil
}

func (d *Device) exit() {
	runtime.UnlockOSThread()
	d.mu.Unlock()
}

// begin is enter for a queued operation: it reports whether op is to run, false when an
// earlier failure is latched or enter failed (which it latches). The caller defers d.exit.
func (d *Device) begin() bool {
	err := d.enter()
	if d.err != nil {
		return false
	}
	if err != nil {
		d.err = err
		return false
	}
	return true
}

// fail latches err, if it is the first failure, wrapped with engine.ErrDevice and what failed.
func (d *Device) fail(what string, err error) {
	if err != nil && d.err == nil {
		if errors.Is(err, engine.ErrDevice) {
			d.err = fmt.Errorf("%s: %w", what, err)
		} else {
			d.err = fmt.Errorf("%w: %s: %w", engine.ErrDevice, what, err)
		}
	}
}

// check latches a failed driver call; it reports whether err was nil.
func (d *Device) check(what string, err error) bool {
	d.fail(what, err)
	return err == nil
}

// need latches an invalid argument of op, described by format, unless ok; it returns ok.
// Arguments are checked before anything is queued because a kernel given a wrong length
// writes past its buffer into whatever the allocator put next to it.
func (d *Device) need(ok bool, op, format string, args ...any) bool {
	if !ok && d.err == nil {
		d.err = fmt.Errorf("%w: %s: %s", engine.ErrDevice, op, fmt.Sprintf(format, args...))
	}
	return ok
}

// Sync waits for the queued work and returns the first error since the last Sync, which it
// clears: an error of an asynchronous kernel (an illegal address) shows here.
func (d *Device) Sync() error {
	err := d.enter()
	defer d.exit()
	if err == nil {
		if err = d.waitStreams(); err != nil {
			err = fmt.Errorf("%w: cuStreamSynchronize: %w", engine.ErrDevice, err)
		} else {
			d.readReport()
		}
	}
	first := d.err
	if first == nil {
		first = err
	}
	d.err = nil
	return first
}

// waitStreams waits for the work queued on both streams, compute and copy.
func (d *Device) waitStreams() error {
	if err := d.stream.Synchronize(); err != nil {
		return err
	}
	return d.copy.Synchronize()
}

// Malloc allocates n elements of t with cuMemAlloc. A full device fails with an error
// wrapping memory.ErrOutOfMemory (and cu.OutOfMemory). Malloc is synchronous and its failure
// is returned, not latched: an allocator may free its cache and try again.
func (d *Device) Malloc(n int, t engine.DType) (engine.Buf, error) {
	if n < 0 || t.Size() == 0 {
		return engine.Buf{}, fmt.Errorf("%w: Malloc(%d, %v): invalid size or type", engine.ErrDevice, n, t)
	}
	if err := d.enter(); err != nil {
		d.exit()
		return engine.Buf{}, err
	}
	defer d.exit()
	bytes := int64(n) * int64(t.Size())
	// cuMemAlloc refuses 0 bytes: an empty allocation gets one element, so that it is, as
	// on the reference device, a distinct live allocation that Release frees.
	p, err := cu.MemAlloc(max(bytes, int64(t.Size())))
	if err != nil {
		if errors.Is(err, cu.OutOfMemory) {
			free, total, _ := cu.MemInfo()
			return engine.Buf{}, fmt.Errorf("%w: cuMemAlloc of %d bytes on %s (%d of %d bytes free): %w",
				memory.ErrOutOfMemory, bytes, d.name, free, total, err)
		}
		return engine.Buf{}, fmt.Errorf("%w: cuMemAlloc of %d bytes: %w", engine.ErrDevice, bytes, err)
	}
	d.live[engine.Ptr(p)] = bytes
	return engine.Buf{Ptr: engine.Ptr(p), N: n, T: t}, nil
}

// Release frees an allocation of Malloc once the queued work (which may still use it) is
// done. It runs even while an error is latched, so memory is not leaked; a failure is
// latched, as is the release of an address that is not a live allocation of d (freed
// already, or never allocated here), which is left alone. Allocators cache, so the wait is
// rare.
func (d *Device) Release(b engine.Buf) {
	if b.Ptr == 0 {
		return
	}
	err := d.enter()
	defer d.exit()
	if _, ok := d.live[b.Ptr]; !ok && err == nil {
		d.need(false, "Release", "%#x is not a live allocation of this device", b.Ptr)
		return
	}
	delete(d.live, b.Ptr)
	if err == nil {
		err = d.waitStreams()
		// Freed even if the queue failed: the context may be lost, but the memory is not.
		if ferr := cu.MemFree(cu.DevicePtr(b.Ptr)); err == nil {
			err = ferr
		}
	}
	d.fail("Release", err)
}
