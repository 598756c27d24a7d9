package nccl

// The parts of a call that need no GPU: describing and checking calls, laying out shards,
// converting to and from the wire type, exchanging the unique id, and waiting with a
// deadline. They are in every build so their tests run on any machine.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"time"
	"unsafe"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/internal/vec"
)

// kind is a collective, as described to the other ranks.
type kind uint64

const (
	kindAllReduce kind = iota + 1
	kindReduceScatter
	kindAllGather
	kindBroadcast
	kindBarrier
	kindInvalid // the call failed validation on this rank: the others must fail it too
)

func (k kind) String() string {
	switch k {
	case kindAllReduce:
		return "all-reduce"
	case kindReduceScatter:
		return "reduce-scatter"
	case kindAllGather:
		return "all-gather"
	case kindBroadcast:
		return "broadcast"
	case kindBarrier:
		return "barrier"
	case kindInvalid:
		return "invalid call"
	}
	return fmt.Sprintf("kind %d", uint64(k))
}

// callName names a call for errors as the ring does: "all-reduce (tag 7)", "(auto tag 3)".
func callName(k kind, tag uint64) string {
	if tag >= collective.MaxUserTag {
		return fmt.Sprintf("%s (auto tag %d)", k, tag-collective.MaxUserTag)
	}
	return fmt.Sprintf("%s (tag %d)", k, tag)
}

// elemDevice marks a device call's element type in a desc, so a host call with an fp16 wire
// and a device call on fp16 data never look alike.
const elemDevice = 0x100

// desc describes a call; every rank must make the same one.
type desc struct {
	kind   kind
	tag    uint64
	n      int    // elements
	elem   uint64 // collective.DType on the wire (half.Format's codes for floats), or elemDevice|format for a device buffer
	op     collective.Op
	root   int
	shards uint64 // shardsHash, 0 without shards
}

// descWords is the length of desc.words.
const descWords = 7

var descFields = [descWords]string{"collective", "tag", "length", "element type", "reduction", "root", "shards"}

func (d desc) words() [descWords]uint64 {
	return [descWords]uint64{uint64(d.kind), d.tag, uint64(d.n), d.elem, uint64(d.op), uint64(d.root), d.shards}
}

// agreeBuf fills buf (2·descWords words) with d's words and their complements. After an
// all-reduce with max, buf[i] is the largest value of field i among the ranks and ^buf[descWords+i]
// the smallest.
func (d desc) agreeBuf(buf []uint64) {
	w := d.words()
	for i, x := range w {
		buf[i], buf[descWords+i] = x, ^x
	}
}

// disagreement reports whether the reduced agreeBuf shows ranks that described a different
// call, naming the fields that differ and their range.
func (d desc) disagreement(reduced []uint64) error {
	var diffs []string
	for i := range descWords {
		hi, lo := reduced[i], ^reduced[descWords+i]
		if hi == lo {
			continue
		}
		switch i {
		case 0:
			diffs = append(diffs, fmt.Sprintf("collective %s..%s", kind(lo), kind(hi)))
		case 1:
			diffs = append(diffs, fmt.Sprintf("tag %s..%s", tagName(lo), tagName(hi)))
		case 3:
			diffs = append(diffs, fmt.Sprintf("element type %s..%s", elemName(lo), elemName(hi)))
		case 4:
			diffs = append(diffs, fmt.Sprintf("reduction %v..%v", collective.Op(lo), collective.Op(hi)))
		case 6:
			diffs = append(diffs, "shards")
		default:
			diffs = append(diffs, fmt.Sprintf("%s %d..%d", descFields[i], lo, hi))
		}
	}
	if diffs == nil {
		return nil
	}
	return fmt.Errorf("ranks made different calls (%s; this rank made a %s of %d %s elements): %w",
		strings.Join(diffs, ", "), d.kind, d.n, elemName(d.elem), collective.ErrProtocol)
}

func tagName(t uint64) string {
	if t >= collective.MaxUserTag {
		return fmt.Sprintf("auto %d", t-collective.MaxUserTag)
	}
	return fmt.Sprint(t)
}

func elemName(e uint64) string {
	if e&elemDevice != 0 {
		return "device " + half.Format(e&^elemDevice).String()
	}
	return collective.DType(e).String()
}

// shardsHash is FNV-1a over the shard bounds.
func shardsHash(s collective.Shards) uint64 {
	h := uint64(14695981039346656037)
	for _, b := range s {
		for k := 0; k < 64; k += 8 {
			h ^= uint64(b) >> k & 0xff
			h *= 1099511628211
		}
	}
	return h | 1 // never 0, which means "no shards"
}

// maxShard is the largest shard: NCCL's per-rank count, each shard padded to it.
func maxShard(s collective.Shards) int {
	m := 0
	for r := 0; r+1 < len(s); r++ {
		m = max(m, s[r+1]-s[r])
	}
	return m
}

// validate checks a call's arguments as the ring does (collective.ValidateCall); every
// error is the caller's.
func validate(k kind, n, size int, shards collective.Shards, op collective.Op, root int, c collective.Call) error {
	return collective.ValidateCall(k.op(), n, size, shards, op, root, c)
}

// op is the collective package's name for k (0 for kindInvalid, which no call validates).
func (k kind) op() uint8 {
	switch k {
	case kindAllReduce:
		return collective.OpAllReduce
	case kindReduceScatter:
		return collective.OpReduceScatter
	case kindAllGather:
		return collective.OpAllGather
	case kindBroadcast:
		return collective.OpBroadcast
	case kindBarrier:
		return collective.OpBarrier
	}
	return 0
}

// dataType is the NCCL element type of a format.
func dataType(f half.Format) int32 {
	switch f {
	case half.FP16:
		return ncclFloat16
	case half.BF16:
		return ncclBfloat16
	}
	return ncclFloat32
}

// redOp is the NCCL reduction of op. Host calls divide for Avg themselves (hostAvg), so
// they reduce with a sum.
func redOp(op collective.Op, hostAvg bool) int32 {
	switch {
	case op == collective.Max:
		return ncclMax
	case op == collective.Min:
		return ncclMin
	case op == collective.Avg && !hostAvg:
		return ncclAvg
	}
	return ncclSum
}

// encodeWire writes src in format w into dst (len(src)·w.Bytes() bytes, aligned to the
// element size, as pinned staging memory is).
func encodeWire(dst []byte, src []float32, w half.Format) {
	if len(src) == 0 {
		return
	}
	switch w {
	case half.FP16:
		vec.EncodeF16(u16s(dst, len(src)), src)
	case half.BF16:
		vec.EncodeBF16(u16s(dst, len(src)), src)
	default:
		copy(f32s(dst, len(src)), src)
	}
}

// decodeWire reads len(dst) elements of format w from src.
func decodeWire(dst []float32, src []byte, w half.Format) {
	if len(dst) == 0 {
		return
	}
	switch w {
	case half.FP16:
		vec.DecodeF16(dst, u16s(src, len(dst)))
	case half.BF16:
		half.DecodeBF16(dst, u16s(src, len(dst)))
	default:
		copy(dst, f32s(src, len(dst)))
	}
}

// finishAvg turns a reduced sum into the average of n ranks as the ring computes it: divided
// in float32, then rounded to the wire type.
func finishAvg(x []float32, n int, w half.Format) {
	if n == 1 {
		return
	}
	d := float32(n)
	for i := range x {
		x[i] /= d
	}
	vec.Round(x, w)
}

func u16s(b []byte, n int) []uint16 {
	if len(b) < 2*n || uintptr(unsafe.Pointer(&b[0]))%2 != 0 {
		panic(fmt.Sprintf("nccl: %d bytes at %p do not hold %d aligned 16-bit words", len(b), &b[0], n))
	}
	return unsafe.Slice((*uint16)(unsafe.Pointer(&b[0])), n)
}

// i64Bytes views x as its bytes, for staging AllReduceInt64's elements as they are.
func i64Bytes(x []int64) []byte {
	if len(x) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&x[0])), 8*len(x))
}

func f32s(b []byte, n int) []float32 {
	if len(b) < 4*n || uintptr(unsafe.Pointer(&b[0]))%4 != 0 {
		panic(fmt.Sprintf("nccl: %d bytes at %p do not hold %d aligned float32s", len(b), &b[0], n))
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(&b[0])), n)
}

// idMsgLen is the unique-id message rank 0 broadcasts: its NCCL version (NCCL_VERSION_CODE,
// a little-endian int64, so a rank whose NCCL fails to join can say which versions met), then
// the 128 bytes of the id.
const idMsgLen = 8 + uniqueIDBytes

// exchangeID gives every rank rank 0's unique id over boot. local is this rank's setup error
// (loading NCCL, opening its GPU); newID makes the id on rank 0. First the ranks all-reduce
// (int64 sum) who failed, so that one rank's failure fails every rank at once with an error
// naming it; then rank 0 broadcasts its NCCL version and the id as bytes.
func exchangeID(ctx context.Context, boot collective.Communicator, local error, newID func() (uniqueID, error), version int) (uniqueID, int, error) {
	rank, size := boot.Rank(), boot.Size()
	var id uniqueID
	if rank == 0 && local == nil {
		id, local = newID()
	}
	failed := make([]int64, size)
	if local != nil {
		failed[rank] = 1
	}
	if err := boot.AllReduceInt64(ctx, failed, collective.Sum); err != nil {
		err = fmt.Errorf("nccl: bootstrap: telling the other ranks whether NCCL started: %w", err)
		return id, 0, errors.Join(local, err)
	}
	if local != nil {
		return id, 0, local
	}
	var bad []string
	for r, f := range failed {
		if f != 0 {
			bad = append(bad, fmt.Sprint(r))
		}
	}
	if bad != nil {
		return id, 0, fmt.Errorf("nccl: rank %s could not start NCCL (see its log); this rank gives up too", strings.Join(bad, ", "))
	}
	msg := make([]byte, idMsgLen)
	if rank == 0 {
		binary.LittleEndian.PutUint64(msg, uint64(version))
		copy(msg[8:], id.Internal[:])
	}
	if err := boot.BroadcastBytes(ctx, msg, 0); err != nil {
		return id, 0, fmt.Errorf("nccl: bootstrap: broadcasting the unique id: %w", err)
	}
	copy(id.Internal[:], msg[8:])
	return id, int(int64(binary.LittleEndian.Uint64(msg))), nil
}

// expiredError is a call's context ending while NCCL worked: it names the deadline.
type expiredError struct {
	err      error // ctx.Err()
	cause    error // context.Cause(ctx) when it says more (the communicator's timeout)
	deadline time.Time
	at       time.Time
}

func (e *expiredError) Error() string {
	msg := e.err.Error()
	if e.cause != nil {
		msg = e.cause.Error()
	}
	switch {
	case e.deadline.IsZero():
		return msg + " (cancelled; the context had no deadline)"
	case errors.Is(e.err, context.DeadlineExceeded):
		return fmt.Sprintf("%s (deadline %s, passed %v before this rank gave up)",
			msg, e.deadline.Format("15:04:05.000"), max(e.at.Sub(e.deadline), 0).Round(time.Millisecond))
	}
	return fmt.Sprintf("%s (cancelled before its deadline %s)", msg, e.deadline.Format("15:04:05.000"))
}

func (e *expiredError) Unwrap() []error {
	if e.cause != nil {
		return []error{e.err, e.cause}
	}
	return []error{e.err}
}

func expired(ctx context.Context) error {
	dl, _ := ctx.Deadline()
	e := &expiredError{err: ctx.Err(), deadline: dl, at: time.Now()}
	if cause := context.Cause(ctx); cause != nil && cause != e.err {
		e.cause = cause
	}
	return e
}

// DefaultTimeout bounds every NCCL call and the communicator's creation, on top of their
// contexts: the training loop's contexts have no deadline (the ring detects a silent peer by
// itself), but NCCL would wait forever for a dead rank between GPUs of one machine.
const DefaultTimeout = 2 * time.Minute

// bounded is ctx limited to timeout (none when timeout <= 0); its cause names the timeout.
func bounded(ctx context.Context, timeout time.Duration) (context.Context, context.CancelFunc) {
	if timeout <= 0 {
		return ctx, func() {}
	}
	return context.WithTimeoutCause(ctx, timeout,
		fmt.Errorf("no answer within the communicator's timeout of %v: %w", timeout, collective.ErrTimeout))
}

// poll calls step until it reports done or fails, or ctx ends (an *expiredError). It spins
// (yielding) for the first polls, which is what a small collective between GPUs of one
// machine needs, then sleeps longer and longer up to half a millisecond.
func poll(ctx context.Context, step func() (done bool, err error)) error {
	for i := 0; ; i++ {
		done, err := step()
		if err != nil || done {
			return err
		}
		if ctx.Err() != nil {
			return expired(ctx)
		}
		if i < 200 {
			runtime.Gosched()
		} else {
			time.Sleep(min(time.Duration(i-199)*5*time.Microsecond, 500*time.Microsecond))
		}
	}
}
