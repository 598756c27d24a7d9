package grpcnet

import (
	"fmt"
	"sync/atomic"

	"google.golang.org/grpc/encoding"
	"google.golang.org/grpc/mem"

	"github.com/qvd/qvd/collective"
)

// codecName is the content-subtype of frame streams ("application/grpc+qvdframe"). The
// server finds the codec by this name, so it is registered process-wide; clients force it
// per stream.
const codecName = "qvdframe"

// The server side of a stream looks its codec up in gRPC's registry by content-subtype,
// and the registry may only be written during initialisation.
func init() { encoding.RegisterCodecV2(frameCodec{}) }

// frameCodec moves frames as raw bytes: a message is the 40-byte collective header followed
// by the payload. It implements encoding.CodecV2 so that neither direction copies a payload
// through protobuf: Marshal lends gRPC the sender's bytes (sendSlot) and Unmarshal keeps
// references to gRPC's receive buffers (inFrame) until Recv copies out of them.
type frameCodec struct{}

var _ encoding.CodecV2 = frameCodec{}

func (frameCodec) Name() string { return codecName }

func (frameCodec) Marshal(v any) (mem.BufferSlice, error) {
	switch m := v.(type) {
	case *sendSlot:
		return m.marshal(), nil
	case *copiedFrame:
		return mem.BufferSlice{m.buf}, nil // gRPC frees it into its pool once written
	case *rawFrame:
		// Immutable bytes made for this one message (hellos, heartbeats): gRPC may keep
		// them as long as it likes.
		return mem.BufferSlice{mem.SliceBuffer(m.b)}, nil
	}
	return nil, fmt.Errorf("grpcnet: the frame codec cannot marshal a %T", v)
}

func (frameCodec) Unmarshal(data mem.BufferSlice, v any) error {
	f, ok := v.(*inFrame)
	if !ok {
		return fmt.Errorf("grpcnet: the frame codec cannot unmarshal into a %T", v)
	}
	f.load(data)
	return nil
}

// copiedFrame is a whole message copied into a buffer of gRPC's pool (transport.copySends).
type copiedFrame struct{ buf mem.Buffer }

// rawFrame is a whole message (header and payload) in bytes nobody modifies afterwards.
type rawFrame struct{ b []byte }

func newRawFrame(h collective.Header, payload []byte) *rawFrame {
	b := make([]byte, collective.HeaderSize+len(payload))
	h.Length = uint32(len(payload))
	collective.PutHeader(b, h)
	copy(b[collective.HeaderSize:], payload)
	return &rawFrame{b: b}
}

// smallPayload is the largest payload Send copies into the slot's own buffer instead of
// lending gRPC the caller's bytes: copying 32 KiB costs a few microseconds, and gRPC only
// reports the release of buffers of at least 1 KiB (mem.IsBelowBufferPoolingThreshold), so
// lending needs a payload at least that large anyway.
const smallPayload = 32 << 10

// sendSlot is one link's frame in flight. It is the mem.BufferPool of the buffers it lends
// gRPC: gRPC calls Put when it has finished with a buffer (copied its bytes into the
// connection's write buffer, or dropped the frame), and when every lent buffer is back the
// slot signals released. Send returns only after that signal, so the caller may then reuse
// its payload: this is what makes lending safe, where returning when SendMsg returns is not
// (SendMsg only queues the frame for gRPC's writer goroutine).
type sendSlot struct {
	// stage holds the header and, for small frames, the payload. Its capacity is above
	// gRPC's pooling threshold so that its release is reported too.
	stage []byte
	// hdr and payload are the byte ranges lent for the current frame; mem.NewBuffer keeps a
	// pointer to each field.
	hdr     []byte
	payload []byte
	bufs    [2]mem.Buffer
	n       int // buffers in this frame: 1 (header with a copied payload) or 2
	// marshaled reports that gRPC took the buffers (Marshal ran during SendMsg); if SendMsg
	// failed before that, no release will come.
	marshaled bool
	pending   atomic.Int32
	released  chan struct{}
}

var _ mem.BufferPool = (*sendSlot)(nil)

func newSendSlot() *sendSlot {
	return &sendSlot{
		stage:    make([]byte, collective.HeaderSize+smallPayload),
		released: make(chan struct{}, 1),
	}
}

// load prepares the slot for a frame whose header is already encoded in stage.
func (s *sendSlot) load(payload []byte) {
	if len(payload) <= smallPayload {
		n := copy(s.stage[collective.HeaderSize:], payload)
		s.hdr, s.payload, s.n = s.stage[:collective.HeaderSize+n], nil, 1
	} else {
		s.hdr, s.payload, s.n = s.stage[:collective.HeaderSize], payload, 2
	}
	s.marshaled = false
}

// marshal is called by gRPC, in the sending goroutine, once per SendMsg.
func (s *sendSlot) marshal() mem.BufferSlice {
	s.marshaled = true
	s.pending.Store(int32(s.n))
	s.bufs[0] = mem.NewBuffer(&s.hdr, s)
	if s.n == 2 {
		s.bufs[1] = mem.NewBuffer(&s.payload, s)
	}
	return s.bufs[:s.n]
}

// Put is called by gRPC when the last reference to one of the lent buffers is freed.
func (s *sendSlot) Put(*[]byte) {
	if s.pending.Add(-1) == 0 {
		s.released <- struct{}{}
	}
}

// Get is never called for lent buffers; it exists to satisfy mem.BufferPool.
func (s *sendSlot) Get(n int) *[]byte {
	b := make([]byte, n)
	return &b
}

// forget drops the slot's references to the caller's payload after its release.
func (s *sendSlot) forget() {
	s.payload = nil
	s.bufs = [2]mem.Buffer{}
}

// inFrame is a received frame: its parsed header and references to the gRPC receive buffers
// that hold it, kept from Unmarshal until Recv has copied the payload out.
type inFrame struct {
	hdr  collective.Header
	err  error // why the message is not a well-formed frame (wraps collective.ErrProtocol)
	raw  [collective.HeaderSize]byte
	bufs []mem.Buffer // the whole message; the payload starts HeaderSize bytes in
}

// load parses a message. A malformed one is recorded in f.err rather than returned, so that
// the reader reports the exact ErrProtocol reason instead of gRPC's generic unmarshal error.
func (f *inFrame) load(data mem.BufferSlice) {
	f.err = nil
	total := data.Len()
	if total < collective.HeaderSize {
		f.err = fmt.Errorf("%w: a message of %d bytes is shorter than a frame header", collective.ErrProtocol, total)
		return
	}
	n := 0
	for _, b := range data {
		if n == collective.HeaderSize {
			break
		}
		n += copy(f.raw[n:], b.ReadOnlyData())
	}
	h, err := collective.ParseHeader(f.raw[:])
	if err != nil {
		f.err = err
		return
	}
	if int(h.Length) != total-collective.HeaderSize {
		f.err = fmt.Errorf("%w: frame header says %d payload bytes, the message carries %d",
			collective.ErrProtocol, h.Length, total-collective.HeaderSize)
		return
	}
	f.hdr = h
	data.Ref()
	f.bufs = append(f.bufs[:0], data...)
}

// copyPayload copies the payload into dst, which must hold f.hdr.Length bytes.
func (f *inFrame) copyPayload(dst []byte) int {
	skip, n := collective.HeaderSize, 0
	for _, b := range f.bufs {
		d := b.ReadOnlyData()
		if skip >= len(d) {
			skip -= len(d)
			continue
		}
		n += copy(dst[n:], d[skip:])
		skip = 0
	}
	return n
}

// payload returns a copy of the payload (handshakes only: it allocates).
func (f *inFrame) payload() []byte {
	b := make([]byte, f.hdr.Length)
	f.copyPayload(b)
	return b
}

// release hands gRPC's receive buffers back to its pool.
func (f *inFrame) release() {
	for i, b := range f.bufs {
		b.Free()
		f.bufs[i] = nil
	}
	f.bufs = f.bufs[:0]
}
