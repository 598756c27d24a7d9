//go:build cuda

package cuda

import (
	"unsafe"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/pinned"
	"github.com/qvd/qvd/internal/vec"
)

// Upload copies src into dst, rounding to dst.T on the host (vec's conversions, bit-identical
// to internal/half). It returns once src has been converted into pinned staging chunks: the
// copies run on the compute stream after the work queued before, and src may be reused.
func (d *Device) Upload(dst engine.Buf, src []float32) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs("Upload", dst) || !d.need(dst.T.Float(), "Upload", "dst is %v; labels go through UploadInt32", dst.T) ||
		!d.need(len(src) == dst.N, "Upload", "%d values for a buffer of %d elements", len(src), dst.N) {
		return
	}
	d.upload("Upload", &d.stage, d.stream, dst, func(b []byte, off, n int) { encode(dst.T, b, src[off:off+n]) })
}

// UploadInt32 copies src into dst (I32).
func (d *Device) UploadInt32(dst engine.Buf, src []int32) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs("UploadInt32", dst) || !d.need(dst.T == engine.I32, "UploadInt32", "dst is %v, not i32", dst.T) ||
		!d.need(len(src) == dst.N, "UploadInt32", "%d values for a buffer of %d elements", len(src), dst.N) {
		return
	}
	d.upload("UploadInt32", &d.stage, d.stream, dst, func(b []byte, off, n int) {
		copy(unsafe.Slice((*int32)(unsafe.Pointer(&b[0])), n), src[off:off+n])
	})
}

// UploadAsync is Upload on the copy stream, so that it overlaps the compute stream's work
// (the next layer's parameters while this one computes). The copy starts after the compute
// work queued before the call (which may still read dst); the compute stream sees the new
// contents only after WaitUploads. Staging is separate from Upload's.
func (d *Device) UploadAsync(dst engine.Buf, src []float32) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs("UploadAsync", dst) || !d.need(dst.T.Float(), "UploadAsync", "dst is %v, not a floating-point type", dst.T) ||
		!d.need(len(src) == dst.N, "UploadAsync", "%d values for a buffer of %d elements", len(src), dst.N) {
		return
	}
	if !d.check("UploadAsync: cuEventRecord", d.computeEv.Record(d.stream)) ||
		!d.check("UploadAsync: cuStreamWaitEvent", d.copy.Wait(d.computeEv, 0)) {
		return
	}
	d.upload("UploadAsync", &d.copyStage, d.copy, dst, func(b []byte, off, n int) { encode(dst.T, b, src[off:off+n]) })
}

// WaitUploads makes the compute stream wait (on the device, not the host) for the copies
// UploadAsync has queued so far.
func (d *Device) WaitUploads() {
	ok := d.begin()
	defer d.exit()
	if !ok {
		return
	}
	if d.check("WaitUploads: cuEventRecord", d.copyDoneEv.Record(d.copy)) {
		d.check("WaitUploads: cuStreamWaitEvent", d.stream.Wait(d.copyDoneEv, 0))
	}
}

// pendingDownload is a DownloadAsync copy waiting to be converted into dst.
type pendingDownload struct {
	dst []float32
	off int // into dlStage, bytes
	t   engine.DType
}

// DownloadAsync queues a copy of src into pinned memory on the copy stream, after the compute
// work queued so far (the kernels that wrote src): the copy overlaps the compute stream's next
// work — the gradient of the layer below while this one's travels. WaitDownloads waits for
// the copies and converts them into dst, which must not be read before.
func (d *Device) DownloadAsync(dst []float32, src engine.Buf) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs("DownloadAsync", src) || !d.need(src.T.Float(), "DownloadAsync", "src is %v, not a floating-point type", src.T) ||
		!d.need(len(dst) == src.N, "DownloadAsync", "%d values for a buffer of %d elements", len(dst), src.N) || src.N == 0 {
		return
	}
	size := (src.Bytes() + 255) &^ 255
	if d.dlUsed+size > d.dlStage.Len() {
		// Grow only when no copy uses the memory: convert what is pending first.
		if !d.drainDownloads() || !d.check("DownloadAsync: cuMemAllocHost", d.dlStage.Alloc(max(size, 2*d.dlStage.Len()))) {
			return
		}
	}
	if !d.check("DownloadAsync: cuEventRecord", d.computeEv.Record(d.stream)) ||
		!d.check("DownloadAsync: cuStreamWaitEvent", d.copy.Wait(d.computeEv, 0)) {
		return
	}
	at := d.dlStage.At(d.dlUsed)
	if !d.check("DownloadAsync: cuMemcpyDtoHAsync", cu.MemcpyDtoHAsync(at, cu.DevicePtr(src.Addr()), int64(src.Bytes()), d.copy)) {
		return
	}
	d.dlPending = append(d.dlPending, pendingDownload{dst: dst, off: d.dlUsed, t: src.T})
	d.dlUsed += size
}

// WaitDownloads waits for DownloadAsync's copies, converts them into their destinations and
// returns the first error since the last Sync, which it clears (as Download does).
func (d *Device) WaitDownloads() error {
	err := d.enter()
	defer d.exit()
	if d.err == nil && err != nil {
		d.err = err
	}
	d.drainDownloads()
	err, d.err = d.err, nil
	return err
}

// drainDownloads synchronises the copy stream and converts every pending download.
func (d *Device) drainDownloads() bool {
	if len(d.dlPending) == 0 {
		d.dlUsed = 0
		return true
	}
	if !d.check("WaitDownloads: cuStreamSynchronize", d.copy.Synchronize()) {
		d.dlPending, d.dlUsed = d.dlPending[:0], 0
		return false
	}
	for _, p := range d.dlPending {
		decode(p.t, p.dst, d.dlStage.Bytes(p.off + len(p.dst)*p.t.Size())[p.off:])
	}
	d.dlPending, d.dlUsed = d.dlPending[:0], 0
	return true
}

// upload copies dst.N elements into dst through st's chunks on stream; fill writes elements
// [off, off+n) into a chunk.
func (d *Device) upload(what string, st *stager, stream cu.Stream, dst engine.Buf, fill func(chunk []byte, off, n int)) {
	size := dst.T.Size()
	per := stageChunk / size
	for off := 0; off < dst.N; off += per {
		n := min(per, dst.N-off)
		i, buf, err := st.take()
		if !d.check(what, err) {
			return
		}
		fill(buf.Bytes(n*size), off, n)
		at := cu.DevicePtr(dst.Addr() + uint64(off*size))
		if !d.check(what+": cuMemcpyHtoDAsync", cu.MemcpyHtoDAsync(at, buf.Ptr(), int64(n*size), stream)) ||
			!d.check(what, st.queued(i, stream)) {
			return
		}
	}
}

// Download waits for the queued work and copies src into dst, converting to float32 (I32
// values too). Like Sync (and the reference device) it returns the first error since the
// last Sync and clears it; dst is untouched when an error was latched before.
func (d *Device) Download(dst []float32, src engine.Buf) error {
	err := d.enter()
	defer d.exit()
	if d.err == nil && err != nil {
		d.err = err
	}
	d.download(dst, src)
	err, d.err = d.err, nil
	return err
}

func (d *Device) download(dst []float32, src engine.Buf) {
	if d.err != nil || !d.bufs("Download", src) ||
		!d.need(src.T.Size() > 0, "Download", "src has no element type") ||
		!d.need(len(dst) == src.N, "Download", "%d values for a buffer of %d elements", len(dst), src.N) {
		return
	}
	size := src.T.Size()
	per := stageChunk / size
	type chunk struct {
		slot, off, n int
		buf          *pinned.Buffer
	}
	var prev chunk
	drain := func(c chunk) bool {
		if !d.check("Download", d.stage.wait(c.slot)) {
			return false
		}
		decode(src.T, dst[c.off:c.off+c.n], c.buf.Bytes(c.n*size))
		return true
	}
	// Chunk k's copy is queued before chunk k-1 is converted, so the two overlap.
	for off := 0; off < src.N; off += per {
		n := min(per, src.N-off)
		i, buf, err := d.stage.take()
		if !d.check("Download", err) {
			return
		}
		from := cu.DevicePtr(src.Addr() + uint64(off*size))
		if !d.check("Download: cuMemcpyDtoHAsync", cu.MemcpyDtoHAsync(buf.Ptr(), from, int64(n*size), d.stream)) ||
			!d.check("Download", d.stage.queued(i, d.stream)) {
			return
		}
		if prev.buf != nil && !drain(prev) {
			return
		}
		prev = chunk{i, off, n, buf}
	}
	if prev.buf != nil && !drain(prev) {
		return
	}
	// Also the queue's asynchronous failures, when src was empty.
	if d.check("Download: cuStreamSynchronize", d.stream.Synchronize()) {
		d.readReport()
	}
}

// encode writes src into b in type t, rounding to nearest even.
func encode(t engine.DType, b []byte, src []float32) {
	if len(src) == 0 {
		return
	}
	p := unsafe.Pointer(&b[0])
	switch t {
	case engine.F32:
		copy(unsafe.Slice((*float32)(p), len(src)), src)
	case engine.F16:
		vec.EncodeF16(unsafe.Slice((*uint16)(p), len(src)), src)
	case engine.BF16:
		vec.EncodeBF16(unsafe.Slice((*uint16)(p), len(src)), src)
	}
}

// decode reads len(dst) elements of type t from b into dst.
func decode(t engine.DType, dst []float32, b []byte) {
	if len(dst) == 0 {
		return
	}
	p := unsafe.Pointer(&b[0])
	switch t {
	case engine.F32:
		copy(dst, unsafe.Slice((*float32)(p), len(dst)))
	case engine.F16:
		vec.DecodeF16(dst, unsafe.Slice((*uint16)(p), len(dst)))
	case engine.BF16:
		half.DecodeBF16(dst, unsafe.Slice((*uint16)(p), len(dst)))
	case engine.I32:
		for i, v := range unsafe.Slice((*int32)(p), len(dst)) {
			dst[i] = float32(v)
		}
	}
}

// Fill sets every element of b to v (rounded to b.T; an I32 buffer gets int32(v)).
func (d *Device) Fill(b engine.Buf, v float32) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs("Fill", b) || b.N == 0 {
		return
	}
	if b.T == engine.I32 {
		d.check("Fill: cuMemsetD32Async", cu.MemsetD32Async(cu.DevicePtr(b.Addr()), uint(uint32(int32(v))), int64(b.N), d.stream))
		return
	}
	if f, ok := d.kernel("Fill", "fill", b.T, 0); ok {
		d.launch("Fill", f, d.blocks(b.N, threads), threads, 1, ptr(b), i64(b.N), f32(v))
	}
}

// Copy copies src into dst: a device-to-device copy for equal types (bits unchanged), the
// convert kernel between floating-point types.
func (d *Device) Copy(dst, src engine.Buf) {
	ok := d.begin()
	defer d.exit()
	if !ok || !d.bufs("Copy", dst, src) || !d.need(dst.N == src.N, "Copy", "dst has %d elements, src %d", dst.N, src.N) || dst.N == 0 {
		return
	}
	if dst.T == src.T {
		d.check("Copy: cuMemcpyDtoDAsync", cu.MemcpyDtoDAsync(cu.DevicePtr(dst.Addr()), cu.DevicePtr(src.Addr()), int64(dst.Bytes()), d.stream))
		return
	}
	if f, ok := d.kernel("Copy", "convert", dst.T, src.T); ok {
		d.launch("Copy", f, d.blocks(dst.N, threads), threads, 1, ptr(dst), ptr(src), i64(dst.N))
	}
}

// zero queues a memset of b to zero bits (+0 in every floating-point type).
func (d *Device) zero(b engine.Buf) error {
	return cu.MemsetD8Async(cu.DevicePtr(b.Addr()), 0, int64(b.Bytes()), d.stream)
}
