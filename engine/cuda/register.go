//go:build cuda

package cuda

import (
	"fmt"

	"gorgonia.org/cu"

	"github.com/qvd/qvd/engine"
)

// The engine overlaps parameter uploads with host work through the copy stream.
var (
	_ engine.AsyncUploader   = (*Device)(nil)
	_ engine.AsyncDownloader = (*Device)(nil)
)

// Linking this package makes device.type cuda available to engine.Open.
func init() {
	engine.Register("cuda", func(ordinal int) (engine.Device, error) {
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
		return 0, fmt.Errorf("%w: cuDeviceGetCount: %w", engine.ErrDevice, err)
	}
	return n, nil
}
