package cluster

import (
	"encoding/json"
	"fmt"

	"google.golang.org/grpc/encoding"
)

// codecName is the gRPC content-subtype of the control service's messages. There is no
// protoc in qvd's build, so the service is described by hand and its messages are JSON.
// gRPC servers pick a codec per call by content-subtype, so this codec must be registered
// in the process (init, as grpc requires) and clients select it with
// grpc.CallContentSubtype; other services on the same server keep their own codecs.
const codecName = "qvd-json"

type jsonCodec struct{}

func (jsonCodec) Marshal(v any) ([]byte, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("cluster: encode %T: %w", v, err)
	}
	return b, nil
}

// maxControlMessage bounds a control-plane message: a roster is the members' names and
// addresses and the job's config, kilobytes. The process's gRPC server admits far larger
// messages for the collectives' frames (grpcnet.ServerOptions), so the bound is here, before
// decoding. Only callers holding the cluster key get this far (ServerOptions).
const maxControlMessage = 4 << 20

func (jsonCodec) Unmarshal(data []byte, v any) error {
	if len(data) > maxControlMessage {
		return fmt.Errorf("cluster: %T message of %d bytes, limit %d", v, len(data), maxControlMessage)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("cluster: decode %T: %w", v, err)
	}
	return nil
}

func (jsonCodec) Name() string { return codecName }

func init() {
	encoding.RegisterCodec(jsonCodec{})
}
