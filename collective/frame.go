package collective

import (
	"encoding/binary"
	"fmt"
)

// Frame kinds.
const (
	KindData  uint8 = 1 // a piece of a collective's buffer
	KindAbort uint8 = 2 // the sender's call failed; payload: UTF-8 reason naming the rank at fault
	KindHello uint8 = 3 // transport handshake (transport-specific payload)
)

// An abort frame (KindAbort) carries the failed call's Tag and Op, and reuses two fields:
// Step is the rank at fault and Piece the rank whose call failed first (the origin), so that
// each rank can name the culprit and the abort stops one hop before it returns to its origin.
// Its payload is the reason in UTF-8, at most a few hundred bytes.

// Collective op codes carried in frames, so a frame from a different call kind is refused.
const (
	OpAllReduce uint8 = iota + 1
	OpReduceScatter
	OpAllGather
	OpBroadcast
	OpBarrier
	// OpShift is Ring.Shift: each rank sends one buffer to its successor (shift.go).
	OpShift
)

// Frame header layout, little-endian, HeaderSize bytes:
//
//	0  magic   uint16  0x5156 ("VQ" on the wire)
//	2  version uint8   FrameVersion
//	3  kind    uint8   KindData, KindAbort, KindHello
//	4  dtype   uint8   DType of the payload elements (half.Format's codes for floats)
//	5  op      uint8   OpAllReduce ... OpShift
//	6  src     uint16  sender's rank
//	8  tag     uint64  call tag
//	16 step    uint32  algorithm step (ring step; all-gather steps follow reduce-scatter's)
//	20 piece   uint32  piece index within the step
//	24 offset  uint64  element offset of the payload in the call's buffer
//	32 count   uint32  elements in the payload
//	36 length  uint32  payload bytes (= count × element size for data frames)
const (
	HeaderSize   = 40
	FrameMagic   = 0x5156
	FrameVersion = 1
	// MaxPayload bounds a frame's payload so a corrupt length can never make a receiver
	// allocate or wait for gigabytes.
	MaxPayload = 64 << 20
)

// Header describes one frame.
type Header struct {
	Kind   uint8
	DType  DType
	Op     uint8
	Src    uint16
	Tag    uint64
	Step   uint32
	Piece  uint32
	Offset uint64
	Count  uint32
	Length uint32
}

// PutHeader encodes h into b[:HeaderSize].
func PutHeader(b []byte, h Header) {
	_ = b[HeaderSize-1]
	binary.LittleEndian.PutUint16(b[0:], FrameMagic)
	b[2] = FrameVersion
	b[3] = h.Kind
	b[4] = uint8(h.DType)
	b[5] = h.Op
	binary.LittleEndian.PutUint16(b[6:], h.Src)
	binary.LittleEndian.PutUint64(b[8:], h.Tag)
	binary.LittleEndian.PutUint32(b[16:], h.Step)
	binary.LittleEndian.PutUint32(b[20:], h.Piece)
	binary.LittleEndian.PutUint64(b[24:], h.Offset)
	binary.LittleEndian.PutUint32(b[32:], h.Count)
	binary.LittleEndian.PutUint32(b[36:], h.Length)
}

// ParseHeader decodes and checks a header: magic, version, kind, element type, and that a
// data frame's length is its count times the element size and within MaxPayload. It never
// panics, whatever the bytes.
func ParseHeader(b []byte) (Header, error) {
	if len(b) < HeaderSize {
		return Header{}, fmt.Errorf("%w: frame header of %d bytes, want %d", ErrProtocol, len(b), HeaderSize)
	}
	if m := binary.LittleEndian.Uint16(b[0:]); m != FrameMagic {
		return Header{}, fmt.Errorf("%w: bad frame magic %#04x (not a qvd peer?)", ErrProtocol, m)
	}
	if v := b[2]; v != FrameVersion {
		return Header{}, fmt.Errorf("%w: frame version %d, this qvd speaks %d", ErrProtocol, v, FrameVersion)
	}
	h := Header{
		Kind: b[3], DType: DType(b[4]), Op: b[5],
		Src:    binary.LittleEndian.Uint16(b[6:]),
		Tag:    binary.LittleEndian.Uint64(b[8:]),
		Step:   binary.LittleEndian.Uint32(b[16:]),
		Piece:  binary.LittleEndian.Uint32(b[20:]),
		Offset: binary.LittleEndian.Uint64(b[24:]),
		Count:  binary.LittleEndian.Uint32(b[32:]),
		Length: binary.LittleEndian.Uint32(b[36:]),
	}
	if h.Length > MaxPayload {
		return Header{}, fmt.Errorf("%w: frame payload of %d bytes exceeds the %d limit", ErrProtocol, h.Length, MaxPayload)
	}
	switch h.Kind {
	case KindData:
		if h.DType.Bytes() == 0 {
			return Header{}, fmt.Errorf("%w: unknown element type %d", ErrProtocol, uint8(h.DType))
		}
		if h.Op < OpAllReduce || h.Op > OpShift {
			return Header{}, fmt.Errorf("%w: unknown collective op %d", ErrProtocol, h.Op)
		}
		if uint64(h.Count)*uint64(h.DType.Bytes()) != uint64(h.Length) {
			return Header{}, fmt.Errorf("%w: %d %s elements need %d bytes, frame says %d", ErrProtocol,
				h.Count, h.DType, uint64(h.Count)*uint64(h.DType.Bytes()), h.Length)
		}
	case KindAbort, KindHello:
	default:
		return Header{}, fmt.Errorf("%w: unknown frame kind %d", ErrProtocol, h.Kind)
	}
	return h, nil
}
