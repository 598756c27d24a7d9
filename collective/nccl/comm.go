//go:build cuda

package nccl

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/pinned"
)

// closeTimeout bounds how long Close waits for ncclCommFinalize before aborting instead.
const closeTimeout = 10 * time.Second

// drainTimeout bounds how long an abort waits for the stream to go idle before the staging
// buffers are given up (leaked rather than freed under a copy that may still run).
const drainTimeout = 10 * time.Second

// Comm is an NCCL communicator of one rank on one GPU (its primary context, which engine/cuda
// shares, so device pointers of the engine are valid here). It implements
// collective.Communicator on host buffers. Calls are serialised; see the package
// documentation for how they are matched between ranks and how they honour their contexts.
type Comm struct {
	lib        *library
	rank, size int
	device     int
	dev        cu.Device
	cuctx      cu.CUContext
	retained   bool // cuctx is the retained primary context
	stream     cu.Stream
	hasStream  bool

	mu      sync.Mutex
	comm    uintptr // ncclComm_t; 0 once aborted or destroyed
	seq     uint64  // the automatic tag sequence
	timeout time.Duration
	closed  bool
	broken  error // why the communicator was aborted; every later call fails
	leak    bool  // the stream did not drain after an abort: keep the buffers

	dbuf   cu.DevicePtr // device staging (host calls) and scratch (device calls with uneven shards)
	dcap   int64
	hbuf   pinned.Buffer // host staging
	agreeD cu.DevicePtr
	agreeH pinned.Buffer
}

var _ collective.Communicator = (*Comm)(nil)

// agreeBytes is the call description all-reduced before every call.
const agreeBytes = 2 * descWords * 8

// New makes the NCCL communicator of the ranks of boot, this rank on GPU device (an index
// among the GPUs CUDA sees, usually the local rank). boot must be a working communicator among
// the same ranks; it is used only during New. Every rank must call New; ctx bounds the whole
// exchange, and if it ends first the half-made communicator is aborted and the error names the
// deadline; the creation of the NCCL communicator is also bounded by DefaultTimeout. A rank
// that cannot load NCCL or open its GPU makes New fail on every rank.
func New(ctx context.Context, boot collective.Communicator, device int) (*Comm, error) {
	if boot == nil {
		return nil, errors.New("nccl: New needs a bootstrap communicator")
	}
	c := &Comm{rank: boot.Rank(), size: boot.Size(), device: device, timeout: DefaultTimeout}
	local := c.setup()
	version := 0
	if c.lib != nil {
		version = c.lib.version
	}
	id, rootVersion, err := exchangeID(ctx, boot, local, c.newID, version)
	if err != nil {
		c.release()
		return nil, err
	}
	ictx, cancel := bounded(ctx, c.timeout)
	defer cancel()
	if err := c.initComm(ictx, id); err != nil {
		if rootVersion != c.lib.version {
			err = fmt.Errorf("%w (rank 0 runs NCCL %s, this rank NCCL %s)", err, versionString(rootVersion), versionString(c.lib.version))
		}
		c.release()
		return nil, err
	}
	return c, nil
}

// setup loads NCCL and opens the GPU: everything a rank does before it talks to the others.
func (c *Comm) setup() error {
	lib, err := loadLibrary()
	if err != nil {
		return err
	}
	c.lib = lib
	n, err := cu.NumDevices()
	if err != nil {
		return fmt.Errorf("nccl: counting the GPUs: %w", err)
	}
	if c.device < 0 || c.device >= n {
		return fmt.Errorf("nccl: rank %d wants GPU %d, but this machine has %d", c.rank, c.device, n)
	}
	if c.dev, err = cu.GetDevice(c.device); err != nil {
		return fmt.Errorf("nccl: GPU %d: %w", c.device, err)
	}
	if c.cuctx, err = c.dev.RetainPrimaryCtx(); err != nil {
		return fmt.Errorf("nccl: GPU %d: retaining its primary context: %w", c.device, err)
	}
	c.retained = true
	leave, err := c.enter()
	if err != nil {
		return err
	}
	defer leave()
	if c.stream, err = cu.MakeStream(cu.NonBlocking); err != nil {
		return fmt.Errorf("nccl: GPU %d: creating a stream: %w", c.device, err)
	}
	c.hasStream = true
	if c.agreeD, err = cu.MemAlloc(agreeBytes); err != nil {
		return fmt.Errorf("nccl: GPU %d: %w", c.device, err)
	}
	if err := c.agreeH.Alloc(agreeBytes); err != nil {
		return fmt.Errorf("nccl: GPU %d: %w", c.device, err)
	}
	return nil
}

// newID is ncclGetUniqueId, on rank 0.
func (c *Comm) newID() (uniqueID, error) {
	var id uniqueID
	if r := c.lib.getUniqueID(&id); r != ncclSuccess {
		return id, fmt.Errorf("nccl: rank 0: %w", c.lib.resultErr("ncclGetUniqueId", r, 0))
	}
	return id, nil
}

// initComm creates the non-blocking communicator and waits, within ctx, until every rank has
// joined it.
func (c *Comm) initComm(ctx context.Context, id uniqueID) error {
	leave, err := c.enter()
	if err != nil {
		return err
	}
	defer leave()
	what := fmt.Sprintf("nccl: creating the communicator of %d ranks (rank %d, GPU %d, NCCL %s)", c.size, c.rank, c.device, c.lib)
	cfg := nonBlocking()
	var comm uintptr
	r := c.lib.commInitRankConfig(&comm, int32(c.size), id, int32(c.rank), &cfg)
	if r != ncclSuccess && r != ncclInProgress {
		err := c.lib.resultErr("ncclCommInitRankConfig", r, comm)
		if comm != 0 {
			c.lib.commAbort(comm)
		}
		return fmt.Errorf("%s: %w", what, err)
	}
	c.comm = comm
	if err := c.settle(ctx, "ncclCommInitRankConfig"); err != nil {
		c.abort()
		return fmt.Errorf("%s: %w; communicator aborted", what, err)
	}
	return nil
}

// enter pins the goroutine to its thread and makes the GPU's context current on it, until
// the returned function undoes both. The driver's current context is per thread.
func (c *Comm) enter() (leave func(), err error) {
	runtime.LockOSThread()
	if err := cu.PushCurrentCtx(c.cuctx); err != nil {
		runtime.UnlockOSThread()
		return nil, fmt.Errorf("nccl: making GPU %d's context current: %w", c.device, err)
	}
	return func() {
		_, _ = cu.PopCurrentCtx()
		runtime.UnlockOSThread()
	}, nil
}

// SetTimeout bounds every later call, on top of its context (DefaultTimeout until set; 0 for
// the context alone). A call that runs out of time aborts the communicator, as when its
// context ends. Give every rank the same timeout: the first rank to give up fails the others.
func (c *Comm) SetTimeout(d time.Duration) {
	c.mu.Lock()
	c.timeout = d
	c.mu.Unlock()
}

// Rank is this rank's index in the group.
func (c *Comm) Rank() int { return c.rank }

// Size is the number of ranks.
func (c *Comm) Size() int { return c.size }

// Device is the index of the GPU the communicator runs on.
func (c *Comm) Device() int { return c.device }

// String is "NCCL 2.21.5 (/usr/lib/x86_64-linux-gnu/libnccl.so.2), rank 0 of 8 on GPU 0".
func (c *Comm) String() string {
	return fmt.Sprintf("NCCL %s, rank %d of %d on GPU %d", c.lib, c.rank, c.size, c.device)
}

// state is ncclCommGetAsyncError: ncclSuccess, ncclInProgress, or the failure.
func (c *Comm) state() (int32, error) {
	var st int32
	if r := c.lib.commGetAsyncError(c.comm, &st); r != ncclSuccess {
		return 0, c.lib.resultErr("ncclCommGetAsyncError", r, c.comm)
	}
	return st, nil
}

// settle waits, within ctx, while the communicator's state is ncclInProgress (a non-blocking
// call still at work), and returns its failure if it has one.
func (c *Comm) settle(ctx context.Context, call string) error {
	return poll(ctx, func() (bool, error) {
		st, err := c.state()
		switch {
		case err != nil:
			return false, err
		case st == ncclSuccess:
			return true, nil
		case st == ncclInProgress:
			return false, nil
		}
		return false, c.lib.resultErr(call, st, c.comm)
	})
}

// issue checks what an enqueueing call returned, waiting out ncclInProgress.
func (c *Comm) issue(ctx context.Context, call string, r int32) error {
	switch r {
	case ncclSuccess:
		return nil
	case ncclInProgress:
		return c.settle(ctx, call)
	}
	return c.lib.resultErr(call, r, c.comm)
}

// sync waits, within ctx, for the stream to finish, watching for NCCL's asynchronous errors
// (a peer that failed) meanwhile and once more when it has: a collective that gave up on a
// failed peer may let the stream finish with its outputs unwritten.
func (c *Comm) sync(ctx context.Context) error {
	return poll(ctx, func() (bool, error) {
		err := c.stream.Query()
		if err != nil && err != cu.NotReady {
			return false, fmt.Errorf("CUDA stream of GPU %d: %w", c.device, err)
		}
		idle := err == nil
		st, err := c.state()
		switch {
		case err != nil:
			return false, err
		case st != ncclSuccess && st != ncclInProgress:
			return false, c.lib.resultErr("NCCL (asynchronous error)", st, c.comm)
		}
		return idle, nil
	})
}

// abort aborts the NCCL communicator (its kernels and threads give up) and waits a while for
// the stream to drain. The context must be current.
func (c *Comm) abort() {
	if c.comm != 0 {
		c.lib.commAbort(c.comm)
		c.comm = 0
	}
	if !c.hasStream {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), drainTimeout)
	defer cancel()
	if err := poll(ctx, func() (bool, error) {
		err := c.stream.Query()
		if err == cu.NotReady {
			return false, nil
		}
		return true, err
	}); err != nil {
		c.leak = true
	}
}

// fail aborts the communicator after a call failed once NCCL had work queued, and makes
// every later call fail too.
func (c *Comm) fail(name string, err error) error {
	err = fmt.Errorf("nccl %s on rank %d: %w; communicator aborted", name, c.rank, err)
	c.abort()
	c.broken = err
	return err
}

// begin takes a call's tag and checks that the communicator can still work; c.mu is held.
func (c *Comm) begin(k kind, tag uint64) (uint64, string, error) {
	if tag == 0 {
		// The sequence advances even for a call that fails, so the ranks stay aligned.
		tag = collective.MaxUserTag + c.seq
		c.seq++
	}
	name := callName(k, tag)
	switch {
	case c.closed:
		return tag, name, fmt.Errorf("nccl %s: %w", name, collective.ErrClosed)
	case c.broken != nil:
		return tag, name, fmt.Errorf("nccl %s on rank %d: the communicator was aborted after an earlier failure (%v): %w",
			name, c.rank, c.broken, collective.ErrClosed)
	}
	return tag, name, nil
}

// ensureDevice makes the device staging buffer hold at least n bytes. Only between calls,
// when the stream is idle.
func (c *Comm) ensureDevice(n int64) error {
	if n <= c.dcap {
		return nil
	}
	n = (n + 1<<20 - 1) &^ (1<<20 - 1)
	if c.dbuf != 0 {
		_ = cu.MemFree(c.dbuf)
		c.dbuf, c.dcap = 0, 0
	}
	p, err := cu.MemAlloc(n)
	if err != nil {
		return fmt.Errorf("nccl: staging %d bytes on GPU %d: %w", n, c.device, err)
	}
	c.dbuf, c.dcap = p, n
	return nil
}

// ensureHost makes the pinned staging buffer hold at least n bytes.
func (c *Comm) ensureHost(n int64) error {
	if n <= int64(c.hbuf.Len()) {
		return nil
	}
	n = (n + 1<<20 - 1) &^ (1<<20 - 1)
	if err := c.hbuf.Alloc(int(n)); err != nil {
		return fmt.Errorf("nccl: pinned staging of %d bytes: %w", n, err)
	}
	return nil
}

func (c *Comm) streamHandle() uintptr { return uintptr(unsafe.Pointer(c.stream.C())) }

// agree all-reduces the call's description (max of its words and of their complements) and
// fails the call on every rank when the ranks described different calls.
func (c *Comm) agree(ctx context.Context, d desc) error {
	buf := unsafe.Slice((*uint64)(c.agreeH.Ptr()), 2*descWords)
	d.agreeBuf(buf)
	if err := cu.MemcpyHtoDAsync(c.agreeD, c.agreeH.Ptr(), agreeBytes, c.stream); err != nil {
		return fmt.Errorf("copying the call's description to GPU %d: %w", c.device, err)
	}
	p := uintptr(c.agreeD)
	if err := c.issue(ctx, "ncclAllReduce", c.lib.allReduce(p, p, 2*descWords, ncclUint64, ncclMax, c.comm, c.streamHandle())); err != nil {
		return err
	}
	if err := cu.MemcpyDtoHAsync(c.agreeH.Ptr(), c.agreeD, agreeBytes, c.stream); err != nil {
		return fmt.Errorf("copying the calls' descriptions from GPU %d: %w", c.device, err)
	}
	if err := c.sync(ctx); err != nil {
		return err
	}
	return d.disagreement(buf)
}

// AllReduce reduces buf across the ranks in place.
func (c *Comm) AllReduce(ctx context.Context, buf []float32, op collective.Op, cl collective.Call) error {
	return c.host(ctx, kindAllReduce, buf, nil, op, 0, cl, false)
}

// ReduceScatter leaves the reduction of shard r in buf[shards[r]:shards[r+1]] on rank r,
// rounded to the wire type. The rest of buf is left as it was.
func (c *Comm) ReduceScatter(ctx context.Context, buf []float32, shards collective.Shards, op collective.Op, cl collective.Call) error {
	return c.host(ctx, kindReduceScatter, buf, shards, op, 0, cl, false)
}

// AllGather fills buf on every rank with every rank's shard, rounded to the wire type (its
// own too, so every rank ends bit-identical).
func (c *Comm) AllGather(ctx context.Context, buf []float32, shards collective.Shards, cl collective.Call) error {
	return c.host(ctx, kindAllGather, buf, shards, collective.Sum, 0, cl, false)
}

// Broadcast copies root's buf, rounded to the wire type, to every rank (root's too).
func (c *Comm) Broadcast(ctx context.Context, buf []float32, root int, cl collective.Call) error {
	return c.host(ctx, kindBroadcast, buf, nil, collective.Sum, root, cl, false)
}

// AllReduceInt64 reduces v across the ranks in place with NCCL's int64 reductions
// (ncclInt64 with ncclSum, ncclMax or ncclMin), staged through the GPU as the float calls
// are: exact, no conversion on the way.
func (c *Comm) AllReduceInt64(ctx context.Context, v []int64, op collective.Op) error {
	return c.exact(ctx, kindAllReduce, i64Bytes(v), len(v), collective.DTypeInt64, op, 0, collective.ValidateInt64(op))
}

// BroadcastBytes copies root's b to every rank (ncclBroadcast of ncclUint8), staged through
// the GPU.
func (c *Comm) BroadcastBytes(ctx context.Context, b []byte, root int) error {
	verr := validate(kindBroadcast, len(b), c.size, nil, collective.Sum, root, collective.Call{})
	return c.exact(ctx, kindBroadcast, b, len(b), collective.DTypeUint8, collective.Sum, root, verr)
}

// exact is the host path of the typed calls: n elements of type dt whose bytes are mem go to
// the GPU as they are, through NCCL, and back. verr is this rank's validation of the call.
// The ranks agree on the call first, as for the float calls.
func (c *Comm) exact(ctx context.Context, k kind, mem []byte, n int, dt collective.DType, op collective.Op, root int, verr error) error {
	ctx, tag, name, done, err := c.open(ctx, k, 0)
	if err != nil {
		return err
	}
	defer done()
	if dt == collective.DTypeUint8 {
		name = "byte " + name // as the ring names it
	} else {
		name = dt.String() + " " + name
	}
	if verr == nil {
		if err := c.ensureDevice(int64(len(mem))); err != nil {
			verr = err
		} else if err := c.ensureHost(int64(len(mem))); err != nil {
			verr = err
		}
	}
	d := desc{kind: k, tag: tag, n: n, elem: uint64(dt), op: op, root: root}
	if verr != nil {
		d = desc{kind: kindInvalid, tag: tag, n: n}
	}
	if err := c.agreeCall(ctx, d, name, verr); err != nil {
		return err
	}
	if n == 0 {
		return nil
	}
	h := c.hbuf.Bytes(c.hbuf.Len())[:len(mem)]
	nb, p, st := int64(len(mem)), uintptr(c.dbuf), c.streamHandle()
	if k == kindAllReduce || c.rank == root {
		copy(h, mem)
		if err := c.upload(0, nb); err != nil {
			return c.fail(name, err)
		}
	}
	var r int32
	if k == kindAllReduce {
		r = c.lib.allReduce(p, p, uintptr(n), ncclInt64, redOp(op, true), c.comm, st)
	} else {
		r = c.lib.broadcast(p, p, uintptr(n), ncclUint8, int32(root), c.comm, st)
	}
	if err := c.issue(ctx, k.ncclName(), r); err != nil {
		return c.fail(name, err)
	}
	if err := c.download(0, nb); err != nil {
		return c.fail(name, err)
	}
	if err := c.sync(ctx); err != nil {
		return c.fail(name, err)
	}
	copy(mem, h)
	return nil
}

// Barrier returns once every rank has entered it: the call-description all-reduce alone.
func (c *Comm) Barrier(ctx context.Context) error {
	ctx, tag, name, done, err := c.open(ctx, kindBarrier, 0)
	if err != nil {
		return err
	}
	defer done()
	if err := c.agree(ctx, desc{kind: kindBarrier, tag: tag}); err != nil {
		if errors.Is(err, collective.ErrProtocol) {
			return fmt.Errorf("nccl %s on rank %d: %w", name, c.rank, err)
		}
		return c.fail(name, err)
	}
	return nil
}

// host is every host-buffer collective. keepWire (tests) uses the wire type even in a group
// of one, which otherwise leaves data untouched by running in fp32.
func (c *Comm) host(ctx context.Context, k kind, buf []float32, shards collective.Shards, op collective.Op, root int, cl collective.Call, keepWire bool) error {
	verr := validate(k, len(buf), c.size, shards, op, root, cl)
	ctx, tag, name, done, err := c.open(ctx, k, cl.Tag)
	if err != nil {
		return err
	}
	defer done()
	wire := cl.Wire
	if c.size == 1 && !keepWire {
		wire = half.FP32
	}
	if verr == nil {
		// Staging comes before the other ranks are told of the call, so that a rank which
		// cannot allocate fails the call on every rank instead of leaving them waiting.
		need := int64(len(buf))
		if k == kindReduceScatter || k == kindAllGather {
			need = int64(c.size * maxShard(shards))
		}
		need *= int64(wire.Bytes())
		if err := c.ensureDevice(need); err != nil {
			verr = err
		} else if err := c.ensureHost(need); err != nil {
			verr = err
		}
	}
	d := desc{kind: k, tag: tag, n: len(buf), elem: uint64(cl.Wire), op: op, root: root}
	if shards != nil {
		d.shards = shardsHash(shards)
	}
	if verr != nil {
		d = desc{kind: kindInvalid, tag: tag, n: len(buf)}
	}
	if err := c.agreeCall(ctx, d, name, verr); err != nil {
		return err
	}
	if err := c.hostRun(ctx, k, buf, shards, op, root, wire); err != nil {
		return c.fail(name, err)
	}
	return nil
}

// hostRun stages buf through the GPU and runs the collective: encode to the wire type into
// pinned memory, upload, NCCL, download, wait, decode.
func (c *Comm) hostRun(ctx context.Context, k kind, buf []float32, shards collective.Shards, op collective.Op, root int, wire half.Format) error {
	eb := int64(wire.Bytes())
	dt := dataType(wire)
	h := c.hbuf.Bytes(c.hbuf.Len())
	d := uintptr(c.dbuf)
	st := c.streamHandle()
	switch k {
	case kindAllReduce, kindBroadcast:
		n := int64(len(buf))
		if n == 0 {
			return nil
		}
		if k == kindAllReduce || c.rank == root {
			encodeWire(h[:n*eb], buf, wire)
			if err := c.upload(0, n*eb); err != nil {
				return err
			}
		}
		var r int32
		if k == kindAllReduce {
			r = c.lib.allReduce(d, d, uintptr(n), dt, redOp(op, true), c.comm, st)
		} else {
			r = c.lib.broadcast(d, d, uintptr(n), dt, int32(root), c.comm, st)
		}
		if err := c.issue(ctx, k.ncclName(), r); err != nil {
			return err
		}
		if err := c.download(0, n*eb); err != nil {
			return err
		}
		if err := c.sync(ctx); err != nil {
			return err
		}
		decodeWire(buf, h[:n*eb], wire)
		if k == kindAllReduce && op == collective.Avg {
			finishAvg(buf, c.size, wire)
		}
		return nil

	case kindReduceScatter, kindAllGather:
		m := int64(maxShard(shards))
		if m == 0 {
			return nil
		}
		slot := m * eb
		own := int64(c.rank) * slot
		lo, hi := shards[c.rank], shards[c.rank+1]
		if k == kindReduceScatter {
			for r := range c.size {
				off, l := int64(r)*slot, int64(shards[r+1]-shards[r])
				encodeWire(h[off:off+l*eb], buf[shards[r]:shards[r+1]], wire)
				clear(h[off+l*eb : off+slot])
			}
			if err := c.upload(0, int64(c.size)*slot); err != nil {
				return err
			}
			if err := c.issue(ctx, "ncclReduceScatter", c.lib.reduceScatter(d, d+uintptr(own), uintptr(m), dt, redOp(op, true), c.comm, st)); err != nil {
				return err
			}
			if err := c.download(own, slot); err != nil {
				return err
			}
			if err := c.sync(ctx); err != nil {
				return err
			}
			decodeWire(buf[lo:hi], h[own:own+slot], wire)
			if op == collective.Avg {
				finishAvg(buf[lo:hi], c.size, wire)
			}
			return nil
		}
		l := int64(hi - lo)
		encodeWire(h[own:own+l*eb], buf[lo:hi], wire)
		clear(h[own+l*eb : own+slot])
		if err := c.upload(own, slot); err != nil {
			return err
		}
		if err := c.issue(ctx, "ncclAllGather", c.lib.allGather(d+uintptr(own), d, uintptr(m), dt, c.comm, st)); err != nil {
			return err
		}
		if err := c.download(0, int64(c.size)*slot); err != nil {
			return err
		}
		if err := c.sync(ctx); err != nil {
			return err
		}
		for r := range c.size {
			off := int64(r) * slot
			decodeWire(buf[shards[r]:shards[r+1]], h[off:off+slot], wire)
		}
		return nil
	}
	return fmt.Errorf("nccl: no host path for %v", k)
}

// upload queues a copy of bytes [off, off+n) of the pinned staging buffer to the same offset
// of the device one.
func (c *Comm) upload(off, n int64) error {
	if err := cu.MemcpyHtoDAsync(c.dbuf+cu.DevicePtr(off), c.hbuf.At(int(off)), n, c.stream); err != nil {
		return fmt.Errorf("copying %d bytes to GPU %d: %w", n, c.device, err)
	}
	return nil
}

// download queues the copy back.
func (c *Comm) download(off, n int64) error {
	if err := cu.MemcpyDtoHAsync(c.hbuf.At(int(off)), c.dbuf+cu.DevicePtr(off), n, c.stream); err != nil {
		return fmt.Errorf("copying %d bytes from GPU %d: %w", n, c.device, err)
	}
	return nil
}

// ncclName is the NCCL function that runs a kind.
func (k kind) ncclName() string {
	switch k {
	case kindAllReduce:
		return "ncclAllReduce"
	case kindReduceScatter:
		return "ncclReduceScatter"
	case kindAllGather:
		return "ncclAllGather"
	case kindBroadcast:
		return "ncclBroadcast"
	}
	return k.String()
}

// AllReduceDevice reduces n elements of type t (half.FP32, FP16 or BF16) at device address
// ptr across the ranks, in place, with NCCL's reductions in t (Avg is ncclAvg, which
// pre-multiplies by 1/size). ptr must be memory of this GPU's primary context, and the
// caller's writes to it complete (its stream synchronised); the call returns once the result
// is in place.
func (c *Comm) AllReduceDevice(ctx context.Context, ptr uint64, n int, t half.Format, op collective.Op) error {
	return c.deviceCall(ctx, kindAllReduce, ptr, n, nil, t, op, 0)
}

// ReduceScatterDevice is ReduceScatter on a device buffer of shards[size] elements of type t:
// the reduction of shard r ends in place on rank r. Even shards run in place; uneven ones go
// through a padded scratch buffer.
func (c *Comm) ReduceScatterDevice(ctx context.Context, ptr uint64, shards collective.Shards, t half.Format, op collective.Op) error {
	n := 0
	if len(shards) > 0 {
		n = shards[len(shards)-1]
	}
	return c.deviceCall(ctx, kindReduceScatter, ptr, n, shards, t, op, 0)
}

// AllGatherDevice is AllGather on a device buffer of shards[size] elements of type t.
func (c *Comm) AllGatherDevice(ctx context.Context, ptr uint64, shards collective.Shards, t half.Format) error {
	n := 0
	if len(shards) > 0 {
		n = shards[len(shards)-1]
	}
	return c.deviceCall(ctx, kindAllGather, ptr, n, shards, t, collective.Sum, 0)
}

// BroadcastDevice copies root's n elements of type t at ptr to every rank's ptr.
func (c *Comm) BroadcastDevice(ctx context.Context, ptr uint64, n int, t half.Format, root int) error {
	return c.deviceCall(ctx, kindBroadcast, ptr, n, nil, t, collective.Sum, root)
}

// open is the prologue every call shares: it takes the communicator's lock (NCCL matches
// calls by order, so a Comm runs one at a time), numbers the call, refuses an expired
// context, bounds the call by the communicator's timeout and makes the device's context
// current. done undoes all of it.
func (c *Comm) open(ctx context.Context, k kind, userTag uint64) (context.Context, uint64, string, func(), error) {
	c.mu.Lock()
	tag, name, err := c.begin(k, userTag)
	if err != nil {
		c.mu.Unlock()
		return ctx, 0, "", nil, err
	}
	if ctx.Err() != nil {
		c.mu.Unlock()
		return ctx, 0, "", nil, fmt.Errorf("nccl %s on rank %d: %w", name, c.rank, expired(ctx))
	}
	ctx, cancel := bounded(ctx, c.timeout)
	leave, err := c.enter()
	if err != nil {
		cancel()
		c.mu.Unlock()
		return ctx, 0, "", nil, err
	}
	return ctx, tag, name, func() { leave(); cancel(); c.mu.Unlock() }, nil
}

// agreeCall has the ranks compare the call d (in a group) and returns the error that ends it:
// a mismatch between ranks, a failed exchange, or this rank's own invalid arguments verr
// (reported after the exchange, so the other ranks fail with a mismatch instead of waiting).
func (c *Comm) agreeCall(ctx context.Context, d desc, name string, verr error) error {
	if c.size > 1 {
		if err := c.agree(ctx, d); err != nil {
			if !errors.Is(err, collective.ErrProtocol) {
				return c.fail(name, errors.Join(verr, err))
			}
			if verr == nil {
				return fmt.Errorf("nccl %s on rank %d: %w", name, c.rank, err)
			}
		}
	}
	if verr != nil {
		return fmt.Errorf("nccl %s on rank %d: %w", name, c.rank, verr)
	}
	return nil
}

// deviceCall is every device-buffer collective.
func (c *Comm) deviceCall(ctx context.Context, k kind, ptr uint64, n int, shards collective.Shards, t half.Format, op collective.Op, root int) error {
	verr := validate(k, n, c.size, shards, op, root, collective.Call{Wire: t})
	if verr == nil && ptr == 0 && n > 0 {
		verr = errors.New("null device pointer")
	}
	ctx, tag, name, done, err := c.open(ctx, k, 0)
	if err != nil {
		return err
	}
	defer done()
	eb := int64(t.Bytes())
	m := int64(maxShard(shards))
	even := true
	for r := 0; r+1 < len(shards); r++ {
		even = even && int64(shards[r+1]-shards[r]) == m
	}
	if verr == nil && !even {
		verr = c.ensureDevice(int64(c.size) * m * eb)
	}
	d := desc{kind: k, tag: tag, n: n, elem: elemDevice | uint64(t), op: op, root: root}
	if shards != nil {
		d.shards = shardsHash(shards)
	}
	if verr != nil {
		d = desc{kind: kindInvalid, tag: tag, n: n}
	}
	if err := c.agreeCall(ctx, d, name, verr); err != nil {
		return err
	}
	if err := c.deviceRun(ctx, k, uintptr(ptr), n, shards, m, even, t, op, root); err != nil {
		return c.fail(name, err)
	}
	return nil
}

func (c *Comm) deviceRun(ctx context.Context, k kind, p uintptr, n int, shards collective.Shards, m int64, even bool, t half.Format, op collective.Op, root int) error {
	if n == 0 {
		return nil
	}
	eb := int64(t.Bytes())
	dt := dataType(t)
	st := c.streamHandle()
	slot := m * eb
	own := int64(c.rank) * slot
	var r int32
	switch k {
	case kindAllReduce:
		r = c.lib.allReduce(p, p, uintptr(n), dt, redOp(op, false), c.comm, st)
	case kindBroadcast:
		r = c.lib.broadcast(p, p, uintptr(n), dt, int32(root), c.comm, st)
	case kindReduceScatter:
		if even {
			r = c.lib.reduceScatter(p, p+uintptr(own), uintptr(m), dt, redOp(op, false), c.comm, st)
			break
		}
		if err := cu.MemsetD8Async(c.dbuf, 0, int64(c.size)*slot, c.stream); err != nil {
			return fmt.Errorf("clearing scratch on GPU %d: %w", c.device, err)
		}
		for s := range c.size {
			if err := c.copyDevice(uintptr(c.dbuf)+uintptr(int64(s)*slot), p+uintptr(int64(shards[s])*eb), int64(shards[s+1]-shards[s])*eb); err != nil {
				return err
			}
		}
		s := uintptr(c.dbuf)
		if err := c.issue(ctx, "ncclReduceScatter", c.lib.reduceScatter(s, s+uintptr(own), uintptr(m), dt, redOp(op, false), c.comm, st)); err != nil {
			return err
		}
		lo, hi := shards[c.rank], shards[c.rank+1]
		if err := c.copyDevice(p+uintptr(int64(lo)*eb), s+uintptr(own), int64(hi-lo)*eb); err != nil {
			return err
		}
		return c.sync(ctx)
	case kindAllGather:
		if even {
			r = c.lib.allGather(p+uintptr(own), p, uintptr(m), dt, c.comm, st)
			break
		}
		s := uintptr(c.dbuf)
		lo, hi := shards[c.rank], shards[c.rank+1]
		if err := c.copyDevice(s+uintptr(own), p+uintptr(int64(lo)*eb), int64(hi-lo)*eb); err != nil {
			return err
		}
		if err := c.issue(ctx, "ncclAllGather", c.lib.allGather(s+uintptr(own), s, uintptr(m), dt, c.comm, st)); err != nil {
			return err
		}
		for q := range c.size {
			if err := c.copyDevice(p+uintptr(int64(shards[q])*eb), s+uintptr(int64(q)*slot), int64(shards[q+1]-shards[q])*eb); err != nil {
				return err
			}
		}
		return c.sync(ctx)
	}
	if err := c.issue(ctx, k.ncclName(), r); err != nil {
		return err
	}
	return c.sync(ctx)
}

// copyDevice queues a device-to-device copy of n bytes on the stream.
func (c *Comm) copyDevice(dst, src uintptr, n int64) error {
	if n == 0 {
		return nil
	}
	if err := cu.MemcpyDtoDAsync(cu.DevicePtr(dst), cu.DevicePtr(src), n, c.stream); err != nil {
		return fmt.Errorf("copying %d bytes on GPU %d: %w", n, c.device, err)
	}
	return nil
}

// Close finalizes and destroys the communicator (aborting it if that does not finish within
// closeTimeout, as when a peer is gone) and frees its buffers; safe to call twice. It is not
// collective, but a peer still running a call when this rank closes will fail that call.
func (c *Comm) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil
	}
	c.closed = true
	return c.release()
}

// release frees whatever setup and initComm made.
func (c *Comm) release() error {
	if !c.retained {
		return nil
	}
	leave, err := c.enter()
	if err != nil {
		return err
	}
	var errs []error
	if c.comm != 0 {
		ctx, cancel := context.WithTimeout(context.Background(), closeTimeout)
		err := c.issue(ctx, "ncclCommFinalize", c.lib.commFinalize(c.comm))
		cancel()
		if err == nil {
			if r := c.lib.commDestroy(c.comm); r != ncclSuccess && r != ncclInProgress {
				errs = append(errs, fmt.Errorf("nccl: closing rank %d: %w", c.rank, c.lib.resultErr("ncclCommDestroy", r, 0)))
			}
			c.comm = 0
		} else {
			errs = append(errs, fmt.Errorf("nccl: closing rank %d: %w; aborted the communicator instead", c.rank, err))
			c.abort()
		}
	}
	if !c.leak {
		if c.dbuf != 0 {
			_ = cu.MemFree(c.dbuf)
			c.dbuf, c.dcap = 0, 0
		}
		if c.agreeD != 0 {
			_ = cu.MemFree(c.agreeD)
			c.agreeD = 0
		}
		c.hbuf.Free()
		c.agreeH.Free()
		if c.hasStream {
			_ = c.stream.Destroy()
			c.hasStream = false
		}
	}
	leave()
	if err := c.dev.ReleasePrimaryCtx(); err != nil {
		errs = append(errs, fmt.Errorf("nccl: releasing GPU %d's context: %w", c.device, err))
	}
	c.retained = false
	return errors.Join(errs...)
}
