package cudaemu

import (
	"errors"
	"fmt"
	"strings"

	"github.com/qvd/qvd/internal/dynlib"
)

// ErrNotEmulated is returned by Open when the process's CUDA driver is not the emulator.
var ErrNotEmulated = errors.New("cudaemu: the CUDA driver is not the emulator")

// Driver is the emulator's libcuda.so.1 as loaded in this process.
type Driver struct {
	lib       *dynlib.Lib
	lastError func(buf *byte, n uintptr) int32
	kernels   func(buf *byte, n uintptr) int32
	setDelay  func(us int64)
}

// Open binds the emulator's extra entry points in the libcuda.so.1 the loader finds
// (LD_LIBRARY_PATH): the one a cuda-tagged binary already has loaded.
func Open() (*Driver, error) {
	lib, err := dynlib.Open(dynlib.Spec{What: "the CUDA driver", Names: []string{"libcuda.so.1"}})
	if err != nil {
		return nil, err
	}
	d := &Driver{lib: lib}
	for _, b := range []struct {
		fn   any
		name string
	}{
		{&d.lastError, "cudaemu_last_error"},
		{&d.kernels, "cudaemu_kernels"},
		{&d.setDelay, "cudaemu_set_delay_us"},
	} {
		if err := lib.Bind(b.fn, b.name); err != nil {
			lib.Close()
			return nil, fmt.Errorf("%w (%s): %w", ErrNotEmulated, lib.Path, err)
		}
	}
	return d, nil
}

// Close releases the library handle (the library stays loaded).
func (d *Driver) Close() error { return d.lib.Close() }

// LastError is the emulator's latest detailed diagnostic: what a CUresult cannot say (the
// kernel, block, thread and allocation of an out-of-bounds access).
func (d *Driver) LastError() string { return d.text(d.lastError) }

// Kernels lists the kernels compiled into the emulator.
func (d *Driver) Kernels() []string { return strings.Fields(d.text(d.kernels)) }

// SetDelay makes every operation queued on a stream wait us microseconds before it runs, so
// that a host read missing its synchronisation sees stale data (QVD_CUDAEMU_DELAY_US).
func (d *Driver) SetDelay(us int) { d.setDelay(int64(us)) }

func (d *Driver) text(fn func(*byte, uintptr) int32) string {
	n := fn(nil, 0)
	buf := make([]byte, n+1)
	fn(&buf[0], uintptr(len(buf)))
	return string(buf[:n])
}
