package tbevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"google.golang.org/protobuf/encoding/protowire"
)

// FileVersion is the file_version of the first event of every event file; TensorBoard reads
// files of this version and later.
const FileVersion = "brain.Event:2"

// Field numbers of tensorflow/core/util/event.proto, framework/summary.proto and
// framework/tensor.proto (as copied into tensorboard/compat/proto).
const (
	eventWallTime    = 1 // double
	eventStep        = 2 // int64
	eventFileVersion = 3 // string, oneof what
	eventSummary     = 5 // Summary, oneof what
	eventSessionLog  = 7 // SessionLog, oneof what

	sessionLogStatus = 1 // SessionStatus enum
	sessionStart     = 1 // SessionStatus START

	summaryValue = 1 // repeated Summary.Value

	valueTag         = 1 // string
	valueSimpleValue = 2 // float, oneof value
	valueTensor      = 8 // TensorProto, oneof value

	tensorDtype   = 1 // DataType enum
	tensorContent = 4 // bytes, little-endian elements
	tensorFloat   = 5 // repeated float, packed
	tensorDouble  = 6 // repeated double, packed

	dtFloat  = 1 // DataType DT_FLOAT
	dtDouble = 2 // DataType DT_DOUBLE
)

// Scalar is one value of a summary: what TensorBoard's scalar dashboard plots under Tag.
// Writers store it as a float32 simple_value, TensorBoard's scalar type.
type Scalar struct {
	Tag   string
	Value float64
}

// Event is the part of tensorflow.Event that scalars use. At most one of FileVersion,
// Scalars and SessionStart is set (they are one protobuf oneof); an Event with none of them
// is what the decoder returns for the kinds it skips (graphs, images, histograms...).
type Event struct {
	WallTime    float64 // seconds since the Unix epoch
	Step        int64
	FileVersion string
	// Scalars is the Summary's values; non-nil (even empty) means the event has a summary.
	Scalars []Scalar
	// SessionStart marks a SessionLog{status: START}: TensorBoard's Python loader
	// (EventAccumulator with purge_orphaned_data, its default) then drops the events at or
	// after Step that came before it, so a run resumed from a checkpoint replaces what it
	// logged after that checkpoint. Readers that do not purge show both.
	SessionStart bool
}

// AppendEvent appends e's protobuf encoding to dst. Fields are in field-number order and
// proto3 zero values are left out, as the C++ and Python serializers do, so the bytes match
// TensorFlow's for the same event.
func AppendEvent(dst []byte, e *Event) []byte {
	if e.WallTime != 0 {
		dst = protowire.AppendTag(dst, eventWallTime, protowire.Fixed64Type)
		dst = protowire.AppendFixed64(dst, math.Float64bits(e.WallTime))
	}
	if e.Step != 0 {
		dst = protowire.AppendTag(dst, eventStep, protowire.VarintType)
		dst = protowire.AppendVarint(dst, uint64(e.Step))
	}
	switch {
	case e.FileVersion != "":
		dst = protowire.AppendTag(dst, eventFileVersion, protowire.BytesType)
		dst = protowire.AppendString(dst, e.FileVersion)
	case e.Scalars != nil:
		dst = protowire.AppendTag(dst, eventSummary, protowire.BytesType)
		dst = protowire.AppendVarint(dst, uint64(summarySize(e.Scalars)))
		for _, s := range e.Scalars {
			dst = protowire.AppendTag(dst, summaryValue, protowire.BytesType)
			dst = protowire.AppendVarint(dst, uint64(valueSize(s)))
			if s.Tag != "" {
				dst = protowire.AppendTag(dst, valueTag, protowire.BytesType)
				dst = protowire.AppendString(dst, s.Tag)
			}
			// simple_value is in a oneof, so it is written even when zero.
			dst = protowire.AppendTag(dst, valueSimpleValue, protowire.Fixed32Type)
			dst = protowire.AppendFixed32(dst, math.Float32bits(float32(s.Value)))
		}
	case e.SessionStart:
		dst = protowire.AppendTag(dst, eventSessionLog, protowire.BytesType)
		dst = protowire.AppendVarint(dst, 2) // the status field below
		dst = protowire.AppendTag(dst, sessionLogStatus, protowire.VarintType)
		dst = protowire.AppendVarint(dst, sessionStart)
	}
	return dst
}

func valueSize(s Scalar) int {
	n := protowire.SizeTag(valueSimpleValue) + protowire.SizeFixed32()
	if s.Tag != "" {
		n += protowire.SizeTag(valueTag) + protowire.SizeBytes(len(s.Tag))
	}
	return n
}

func summarySize(ss []Scalar) int {
	n := 0
	for _, s := range ss {
		n += protowire.SizeTag(summaryValue) + protowire.SizeBytes(valueSize(s))
	}
	return n
}

// errMalformed marks bytes that are not a valid protobuf encoding of the expected message.
var errMalformed = errors.New("malformed protobuf")

// ParseEvent decodes an Event. Fields and summary values it does not know (images,
// histograms, graphs) are skipped; a scalar comes from simple_value or from a rank-0 DT_FLOAT
// or DT_DOUBLE tensor (tf.summary.scalar in TF2).
func ParseEvent(b []byte) (Event, error) {
	var e Event
	err := fields(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		switch {
		case num == eventWallTime && typ == protowire.Fixed64Type:
			e.WallTime = math.Float64frombits(x)
		case num == eventStep && typ == protowire.VarintType:
			e.Step = int64(x)
		case num == eventFileVersion && typ == protowire.BytesType:
			e.FileVersion = string(v)
		case num == eventSummary && typ == protowire.BytesType:
			if e.Scalars == nil {
				e.Scalars = []Scalar{}
			}
			return fields(v, func(num protowire.Number, typ protowire.Type, v []byte, _ uint64) error {
				if num != summaryValue || typ != protowire.BytesType {
					return nil
				}
				s, ok, err := parseValue(v)
				if ok {
					e.Scalars = append(e.Scalars, s)
				}
				return err
			})
		case num == eventSessionLog && typ == protowire.BytesType:
			return fields(v, func(num protowire.Number, typ protowire.Type, _ []byte, x uint64) error {
				if num == sessionLogStatus && typ == protowire.VarintType {
					e.SessionStart = x == sessionStart
				}
				return nil
			})
		}
		return nil
	})
	if err != nil {
		return Event{}, fmt.Errorf("decoding event: %w", err)
	}
	return e, nil
}

// parseValue decodes a Summary.Value; ok is false for values that are not scalars.
func parseValue(b []byte) (s Scalar, ok bool, err error) {
	err = fields(b, func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error {
		switch {
		case num == valueTag && typ == protowire.BytesType:
			s.Tag = string(v)
		case num == valueSimpleValue && typ == protowire.Fixed32Type:
			s.Value, ok = float64(math.Float32frombits(uint32(x))), true
		case num == valueTensor && typ == protowire.BytesType:
			var terr error
			s.Value, ok, terr = parseScalarTensor(v)
			return terr
		}
		return nil
	})
	return s, ok, err
}

// parseScalarTensor reads a tensor holding one float or double, in tensor_content or in
// float_val/double_val (packed or not). Other tensors are not scalars: ok is false.
func parseScalarTensor(b []byte) (v float64, ok bool, err error) {
	var dtype uint64
	var vals []float64
	err = fields(b, func(num protowire.Number, typ protowire.Type, p []byte, x uint64) error {
		switch {
		case num == tensorDtype && typ == protowire.VarintType:
			dtype = x
		case num == tensorContent && typ == protowire.BytesType:
			switch {
			case dtype == dtFloat && len(p) == 4:
				vals = append(vals, float64(math.Float32frombits(binary.LittleEndian.Uint32(p))))
			case dtype == dtDouble && len(p) == 8:
				vals = append(vals, math.Float64frombits(binary.LittleEndian.Uint64(p)))
			}
		case num == tensorFloat && typ == protowire.Fixed32Type:
			vals = append(vals, float64(math.Float32frombits(uint32(x))))
		case num == tensorDouble && typ == protowire.Fixed64Type:
			vals = append(vals, math.Float64frombits(x))
		case num == tensorFloat && typ == protowire.BytesType:
			for ; len(p) >= 4; p = p[4:] {
				vals = append(vals, float64(math.Float32frombits(binary.LittleEndian.Uint32(p))))
			}
		case num == tensorDouble && typ == protowire.BytesType:
			for ; len(p) >= 8; p = p[8:] {
				vals = append(vals, math.Float64frombits(binary.LittleEndian.Uint64(p)))
			}
		}
		return nil
	})
	if err != nil || len(vals) != 1 || (dtype != dtFloat && dtype != dtDouble) {
		return 0, false, err
	}
	return vals[0], true, nil
}

// fields calls fn for each field of the message in b: v is a length-delimited field's bytes,
// x a varint's or fixed field's value. Groups are skipped.
func fields(b []byte, fn func(num protowire.Number, typ protowire.Type, v []byte, x uint64) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return fmt.Errorf("%w: %w", errMalformed, protowire.ParseError(n))
		}
		b = b[n:]
		var v []byte
		var x uint64
		switch typ {
		case protowire.VarintType:
			x, n = protowire.ConsumeVarint(b)
		case protowire.Fixed32Type:
			var x32 uint32
			x32, n = protowire.ConsumeFixed32(b)
			x = uint64(x32)
		case protowire.Fixed64Type:
			x, n = protowire.ConsumeFixed64(b)
		case protowire.BytesType:
			v, n = protowire.ConsumeBytes(b)
		default:
			n = protowire.ConsumeFieldValue(num, typ, b)
		}
		if n < 0 {
			return fmt.Errorf("%w: field %d: %w", errMalformed, num, protowire.ParseError(n))
		}
		b = b[n:]
		if err := fn(num, typ, v, x); err != nil {
			return err
		}
	}
	return nil
}
