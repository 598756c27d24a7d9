//go:build cuda

package cuda

import (
	"fmt"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/gpu"
)

// The engine overlaps parameter uploads with host work through the copy stream.
var (
	_ gpu.AsyncUploader   = (*Device)(nil)
	_ gpu.AsyncDownloader = (*Device)(nil)
)

// Linking this package makes device.type cuda available to gpu.Open.
func init() {
	gpu.Register("cuda", func(ordinal int) (gpu.Device, error) {
		d, err := Open(ordinal)
		if err != nil {
			return nil, err // not a nil *Device inside a non-nil interface
		}
		return d, nil
	}, Count)
}

// Count is the number of CUDA devices the driver sees.
func Count() (int, error) {
	n, err := cu.NumDevices()
	if err != nil {
		return 0, fmt.Errorf("%w: cuDeviceGetCount: %w", gpu.ErrDevice, err)
	}
	return n, nil
}
