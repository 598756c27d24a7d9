//go:build !cuda

package job

import (
	"context"
	"errors"

	"github.com/qvd/qvd/collective"
)

// NCCLAvailable reports whether this binary was built with -tags cuda (NCCL and the cuda
// device backend).
const NCCLAvailable = false

// newNCCL: NCCL comes with the CUDA build.
func newNCCL(context.Context, collective.Communicator, int) (collective.Communicator, error) {
	return nil, errors.New("collective.transport: nccl: this qvd was built without CUDA support (build it with `go build -tags cuda ./cmd/qvd`; see docs/gpu.md)")
}
