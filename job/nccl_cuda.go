//go:build cuda

package job

import (
	"context"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/nccl"
	"github.com/qvd/qvd/engine"
	_ "github.com/qvd/qvd/engine/cuda" // registers device.type cuda with engine.Register
)

// NCCLAvailable reports whether this binary was built with -tags cuda (NCCL and the cuda
// device backend).
const NCCLAvailable = true

// newNCCL makes an NCCL communicator for the GPU ordinal, bootstrapped (its unique id
// exchanged) over the gRPC ring.
func newNCCL(ctx context.Context, bootstrap collective.Communicator, ordinal int) (collective.Communicator, error) {
	c, err := nccl.New(ctx, bootstrap, ordinal)
	if err != nil {
		return nil, err
	}
	return ncclStack{stacked{c, bootstrap}, c}, nil
}

// ncclStack is the NCCL communicator over the gRPC ring it was bootstrapped from; the GPU
// engine's device step all-reduces its gradient through it on the device.
type ncclStack struct {
	stacked
	nc *nccl.Comm
}

// AllReduceBuf reduces a device buffer in place (engine.DeviceReducer).
func (s ncclStack) AllReduceBuf(ctx context.Context, b engine.Buf, op collective.Op) error {
	return s.nc.AllReduceDevice(ctx, b.Addr(), b.N, b.T.Format(), op)
}
