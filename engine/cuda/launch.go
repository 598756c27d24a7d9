//go:build cuda

package cuda

import (
	"fmt"
	"math"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cuda/kernels"
	"github.com/qvd/qvd/internal/pinned"
)

// Block shapes, as kernels.cu defines them (THREADS, TILE).
const (
	threads = 256
	tile    = 32
)

// kernelKey names an entry point: op_a for one type (b = 0), op_a_b for two.
type kernelKey struct {
	op   string
	a, b engine.DType
}

var typeOfSuffix = map[string]engine.DType{"f32": engine.F32, "f16": engine.F16, "bf16": engine.BF16}

// loadKernels looks up every entry point of the module.
func (d *Device) loadKernels() error {
	d.kern = make(map[kernelKey]cu.Function)
	get := func(k kernelKey, types ...string) error {
		name := kernels.Name(k.op, types...)
		f, err := d.mod.Function(name)
		if err != nil {
			return fmt.Errorf("cuModuleGetFunction(%s): %w", name, err)
		}
		d.kern[k] = f
		return nil
	}
	for _, op := range kernels.Unary {
		for _, t := range kernels.Types {
			if err := get(kernelKey{op, typeOfSuffix[t], 0}, t); err != nil {
				return err
			}
		}
	}
	for _, op := range kernels.FromF32 {
		for _, t := range kernels.Types {
			if err := get(kernelKey{op, typeOfSuffix[t], engine.F32}, t, "f32"); err != nil {
				return err
			}
		}
	}
	for _, op := range kernels.Binary {
		for _, a := range kernels.Types {
			for _, b := range kernels.Types {
				if err := get(kernelKey{op, typeOfSuffix[a], typeOfSuffix[b]}, a, b); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// kernel returns the entry point of op for types a (and b), latching an error naming the
// operation when there is none (a non-float type).
func (d *Device) kernel(what, op string, a, b engine.DType) (cu.Function, bool) {
	f, ok := d.kern[kernelKey{op, a, b}]
	if !ok {
		types := a.String()
		if b != 0 {
			types += ", " + b.String()
		}
		d.need(false, what, "no kernel for element types %s", types)
	}
	return f, ok
}

// bufs latches an error naming op unless every view lies inside a live allocation of d
// (one Malloc made and Release has not freed): the zero Buf, a released or foreign address,
// or a view past its allocation's end would make a kernel fault, and a fault loses the
// context for good. It is a map lookup per buffer. Views may reinterpret an allocation's
// bytes in another type (the Allocator reuses blocks so, and so do the convolution's
// workspace views): only the byte range is checked. Optional arguments (frozen gradients)
// are checked with valid(...) of them.
func (d *Device) bufs(op string, bs ...engine.Buf) bool {
	for i, b := range bs {
		size := int64(b.T.Size())
		if size == 0 || b.Ptr == 0 || b.N < 0 || b.Off < 0 {
			return d.need(false, op, "buffer argument %d is not a view of an allocation (%+v)", i+1, b)
		}
		bytes, ok := d.live[b.Ptr]
		if !ok {
			return d.need(false, op, "buffer argument %d: %#x is not a live allocation of this device (released, or never allocated here)", i+1, b.Ptr)
		}
		if (int64(b.Off)+int64(b.N))*size > bytes {
			return d.need(false, op, "buffer argument %d: view [%d, %d) of %v lies outside its allocation of %d bytes", i+1, b.Off, b.Off+b.N, b.T, bytes)
		}
	}
	return true
}

// reportBytes is the size of the kernels' failure report (kernels.cu, report_failure): four
// 64-bit words, the code of the first failure (0: none), its item, value and bound.
const reportBytes = 32

// Codes of the failure report (kernels.cu's REPORT_*).
const (
	reportLabel     = 1
	reportPoolIndex = 2
)

// readReport latches the failure a kernel reported (an argument in device memory out of
// range: a SoftmaxXent label, a MaxPool2Grad index), if such a kernel was queued since the
// last read, and clears the report; the compute stream must be synchronised. Sync and
// Download call it, so they return the error; WaitDownloads, which waits for the copy stream
// only, does not. The operations queued between the failing kernel and the wait still ran,
// as after any failure the device only finds when it runs. The report's error replaces one
// latched since: the kernel was queued while none was latched (or it would have been
// skipped), so its failure is the first.
func (d *Device) readReport() {
	if !d.reportCheck {
		return
	}
	d.reportCheck = false
	var r [4]int64
	if !d.check("reading the kernels' failure report: cuMemcpyDtoH", cu.MemcpyDtoH(unsafe.Pointer(&r[0]), d.report, reportBytes)) || r[0] == 0 {
		return
	}
	var err error
	switch r[0] {
	case reportLabel:
		err = fmt.Errorf("%w: SoftmaxXent: label %d of row %d outside [0, %d)", engine.ErrDevice, r[2], r[1], r[3])
	case reportPoolIndex:
		err = fmt.Errorf("%w: MaxPool2Grad: index %d (of gradient %d) outside dx's %d elements", engine.ErrDevice, r[2], r[1], r[3])
	default:
		err = fmt.Errorf("%w: a kernel reported failure %d (%d, %d, %d)", engine.ErrDevice, r[0], r[1], r[2], r[3])
	}
	if cerr := cu.MemsetD8Async(d.report, 0, reportBytes, d.stream); cerr != nil {
		err = fmt.Errorf("%w (and clearing the report: cuMemsetD8Async: %w)", err, cerr)
	}
	d.err = err
}

// blocks is the grid of a grid-stride launch over n items, per items per block.
func (d *Device) blocks(n, per int) int {
	return int(min(int64(n+per-1)/int64(per), int64(d.maxBlocks)))
}

// launch queues f on the compute stream with a grid of gx blocks of bx × by threads. Every
// argument is passed as an 8-byte word (cu's Launch copies 8 bytes per parameter; a 4-byte
// parameter reads the low half, as the ABI is little-endian): use ptr, i64 and f32. The
// failure report (readReport) is appended as every kernel's last parameter: a kernel does
// nothing while a failure is reported.
func (d *Device) launch(what string, f cu.Function, gx, bx, by int, args ...uint64) {
	if gx <= 0 {
		return
	}
	args = append(args, uint64(d.report))
	kp := make([]unsafe.Pointer, len(args))
	for i := range args {
		kp[i] = unsafe.Pointer(&args[i])
	}
	d.check(what, f.Launch(gx, 1, 1, bx, by, 1, 0, d.stream, kp))
}

func ptr(b engine.Buf) uint64 { return b.Addr() }
func i64(n int) uint64        { return uint64(int64(n)) }
func f32(x float32) uint64    { return uint64(math.Float32bits(x)) }

func flag(b bool) uint64 {
	if b {
		return 1
	}
	return 0
}

// stageChunk is the size of one pinned staging chunk: large enough for the copy engines'
// full rate, small enough that two of them pin little host memory.
const stageChunk = 8 << 20

// stager moves host data through two pinned chunks, so that filling or draining one
// overlaps the copy of the other, and a chunk is never rewritten while a queued copy may
// still read it: each chunk's event marks its last copy.
type stager struct {
	slot [2]pinned.Buffer
	ev   [2]cu.Event
	busy [2]bool
	next int
}

func (s *stager) init() error {
	for i := range s.ev {
		ev, err := cu.MakeEvent(cu.DisableTiming)
		if err != nil {
			return fmt.Errorf("cuEventCreate: %w", err)
		}
		s.ev[i] = ev
	}
	return nil
}

// take returns the next chunk, once its last copy has completed, allocating it on first use.
func (s *stager) take() (int, *pinned.Buffer, error) {
	i := s.next
	s.next ^= 1
	if err := s.wait(i); err != nil {
		return i, nil, err
	}
	if s.slot[i].Ptr() == nil {
		if err := s.slot[i].Alloc(stageChunk); err != nil {
			return i, nil, err
		}
	}
	return i, &s.slot[i], nil
}

// queued records that a copy using chunk i was queued on stream.
func (s *stager) queued(i int, stream cu.Stream) error {
	if err := s.ev[i].Record(stream); err != nil {
		return fmt.Errorf("cuEventRecord: %w", err)
	}
	s.busy[i] = true
	return nil
}

// wait blocks until chunk i's last copy has completed.
func (s *stager) wait(i int) error {
	if !s.busy[i] {
		return nil
	}
	if err := s.ev[i].Synchronize(); err != nil {
		return fmt.Errorf("cuEventSynchronize: %w", err)
	}
	s.busy[i] = false
	return nil
}

// free waits for the chunks' copies and frees them and the events.
func (s *stager) free() {
	for i := range s.slot {
		if s.ev[i] != (cu.Event{}) {
			s.wait(i)
			cu.DestroyEvent(&s.ev[i])
		}
		s.slot[i].Free()
		s.busy[i] = false
	}
}
