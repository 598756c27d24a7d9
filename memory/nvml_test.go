//go:build cgo

package memory

import (
	"errors"
	"io"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// fakeNVML is go-nvml's own mock with count GPUs of the given memory.
func fakeNVML(initRet nvml.Return, mems []nvml.Memory, shutdowns *int) *mock.Interface {
	return &mock.Interface{
		InitFunc:     func() nvml.Return { return initRet },
		ShutdownFunc: func() nvml.Return { *shutdowns++; return nvml.SUCCESS },
		DeviceGetCountFunc: func() (int, nvml.Return) {
			return len(mems), nvml.SUCCESS
		},
		DeviceGetHandleByIndexFunc: func(i int) (nvml.Device, nvml.Return) {
			if i >= len(mems) {
				return nil, nvml.ERROR_INVALID_ARGUMENT
			}
			return &mock.Device{
				GetMemoryInfoFunc: func() (nvml.Memory, nvml.Return) { return mems[i], nvml.SUCCESS },
				GetNameFunc:       func() (string, nvml.Return) { return "NVIDIA A100-SXM4-40GB", nvml.SUCCESS },
			}, nvml.SUCCESS
		},
	}
}

func TestNVMLTwoGPUs(t *testing.T) {
	shutdowns := 0
	src := openNVML(fakeNVML(nvml.SUCCESS, []nvml.Memory{
		{Total: 40 << 30, Free: 30 << 30, Used: 10 << 30},
		{Total: 40 << 30, Free: 39 << 30, Used: 1 << 30},
	}, &shutdowns))
	devs, err := src.Devices()
	if err != nil {
		t.Fatal(err)
	}
	want := []Device{
		{Index: 0, Name: "NVIDIA A100-SXM4-40GB", Used: 10 << 30, Free: 30 << 30, Total: 40 << 30},
		{Index: 1, Name: "NVIDIA A100-SXM4-40GB", Used: 1 << 30, Free: 39 << 30, Total: 40 << 30},
	}
	if len(devs) != 2 || devs[0] != want[0] || devs[1] != want[1] {
		t.Fatalf("devices %+v", devs)
	}
	// The monitor closes NVML once, however often it is closed.
	m, err := New(DefaultConfig(), Options{Host: &fakeHost{}, Device: src})
	if err != nil {
		t.Fatal(err)
	}
	if line := m.Observe(1, nil).DeviceLine(); !strings.HasPrefix(line, "GPU 0 NVIDIA A100-SXM4-40GB: used 10.0 GiB, free 30.0 GiB of 40.0 GiB; GPU 1") {
		t.Fatalf("device line %q", line)
	}
	m.Close()
	m.Close()
	if shutdowns != 1 {
		t.Fatalf("NVML shut down %d times", shutdowns)
	}
}

func TestNVMLAbsent(t *testing.T) {
	for _, c := range []struct {
		ret  nvml.Return
		mems []nvml.Memory
		want string
	}{
		{nvml.ERROR_LIBRARY_NOT_FOUND, nil, "no GPU: NVML not found (libnvidia-ml.so.1 could not be loaded: no NVIDIA driver on this machine)"},
		{nvml.ERROR_DRIVER_NOT_LOADED, nil, "no GPU: NVML found but the NVIDIA driver is not loaded"},
		{nvml.SUCCESS, nil, "no GPU: NVML found no GPU"},
	} {
		shutdowns := 0
		src := openNVML(fakeNVML(c.ret, c.mems, &shutdowns))
		if _, ok := src.(io.Closer); ok {
			t.Errorf("%v: a source without devices holds nothing to close", c.ret)
		}
		_, err := src.Devices()
		if !errors.Is(err, ErrNoDevice) || err.Error() != c.want {
			t.Errorf("%v: err %q, want %q", c.ret, err, c.want)
		}
		if c.ret == nvml.SUCCESS && shutdowns != 1 {
			t.Errorf("NVML started without GPUs must be shut down; shutdowns %d", shutdowns)
		}
	}
}

// TestNVMLLive runs against the real library: on a machine without a driver (CI) it must say
// so, and on one with GPUs it must report plausible figures.
func TestNVMLLive(t *testing.T) {
	src := OpenNVML()
	if c, ok := src.(io.Closer); ok {
		defer c.Close()
	}
	devs, err := src.Devices()
	if err != nil {
		if !errors.Is(err, ErrNoDevice) {
			t.Fatalf("err %v does not wrap ErrNoDevice", err)
		}
		t.Logf("no GPU here: %v", err)
		return
	}
	for _, d := range devs {
		if d.Total == 0 || d.Used > d.Total {
			t.Fatalf("implausible %+v", d)
		}
		t.Logf("%+v", d)
	}
}
