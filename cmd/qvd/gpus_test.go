package main

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/qvd/qvd/memory"
)

func gpus(open func() memory.DeviceSource, args ...string) (int, string, string) {
	var out, errb bytes.Buffer
	code := gpusMain(open, args, &out, &errb)
	return code, out.String(), errb.String()
}

// Without NVML or a GPU, qvd gpus says why and succeeds, unless --require.
func TestGPUsWithoutAGPUSaysWhy(t *testing.T) {
	const reason = "NVML not found (libnvidia-ml.so.1 could not be loaded: no NVIDIA driver on this machine)"
	none := func() memory.DeviceSource { return memory.NoDevices{Reason: reason} }

	code, out, errOut := gpus(none)
	if code != exitOK || out != "No GPU: "+reason+"\n" || errOut != "" {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = gpus(none, "--require")
	if code != exitFailure || out != "" || !strings.Contains(errOut, reason) {
		t.Fatalf("--require: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, _ = gpus(none, "--json")
	var rep struct {
		GPUs   []memory.GPU `json:"gpus"`
		Reason string       `json:"reason"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil || code != exitOK || rep.Reason != reason || rep.GPUs == nil || len(rep.GPUs) != 0 {
		t.Fatalf("--json: exit %d, %v, %q", code, err, out)
	}
	if !strings.Contains(out, `"gpus": []`) {
		t.Errorf("--json lists no GPUs as %q, want an empty list", out)
	}
	if code, _, _ := gpus(none, "extra"); code != exitUsage {
		t.Errorf("a stray argument: exit %d", code)
	}
}

// This machine, through the command line: a table of GPUs where NVML finds some, the reason
// where it does not; never a failure.
func TestGPUsCommandOnThisMachine(t *testing.T) {
	code, out, errOut := runQVD(t, "gpus")
	if code != exitOK || !(strings.HasPrefix(out, "No GPU: ") || strings.Contains(out, "GPU  NAME")) {
		t.Fatalf("exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	t.Logf("%s", out)
}

// A source without the inventory (not NVML) still gives the memory columns.
func TestGPUsFromAPlainDeviceSource(t *testing.T) {
	src := fixedDevices{{Index: 0, Name: "Fake GPU", Used: 1 << 30, Total: 16 << 30}}
	code, out, _ := gpus(func() memory.DeviceSource { return src })
	want := "GPU  NAME      MEMORY USED / TOTAL  GPU UTIL  MEM UTIL  TEMP  POWER\n" +
		"0    Fake GPU  1.0 GiB / 16.0 GiB   -         -         -     -\n"
	if code != exitOK || out != want {
		t.Fatalf("exit %d:\n%s", code, out)
	}
}

type fixedDevices []memory.Device

func (f fixedDevices) Devices() ([]memory.Device, error) { return f, nil }
