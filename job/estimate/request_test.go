package estimate

import (
	"bytes"
	"strings"
	"testing"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/engine"
)

// TestRequestErrors: each refused request is one error naming the flag, before any output.
func TestRequestErrors(t *testing.T) {
	noShape := func(*configs.Config) ([]int, int, error) { t.Fatal("shape asked for"); return nil, 0, nil }
	noDev := func() (engine.Device, error) { t.Fatal("device opened"); return nil, nil }
	base := Request{Params: "1e9", World: 1, Stage: -1}
	for _, tc := range []struct {
		edit func(*Request)
		want string
	}{
		{func(r *Request) { r.Memory = "1GiB" }, "--memory, --effective-batch and --activation-bytes go with --recommend"},
		{func(r *Request) { r.Config = "fashion-mlp" }, "give exactly one of --params and -c"},
		{func(r *Request) { r.World = 0 }, "--world must be >= 1, got 0"},
		{func(r *Request) { r.Params = "x" }, "--params: "},
		{func(r *Request) { r.Stage = 5 }, "--stage must be 0, 1 or 2, got 5"},
		{func(r *Request) { r.Offload = "gpu" }, `--offload must be none or cpu, got "gpu"`},
		{func(r *Request) { r.Accum = -1 }, "--accum must be >= 1, got -1"},
		{func(r *Request) { r.Precision = "fp8" }, "--precision: "},
		{func(r *Request) { r.Optimizer = "lion" }, `--optimizer must be adamw, adam, sgd, adamw8bit or adam8bit, got "lion"`},
	} {
		r := base
		tc.edit(&r)
		var out bytes.Buffer
		if err := r.Run(&out, noShape, noDev); err == nil || !strings.HasPrefix(err.Error(), tc.want) || out.Len() != 0 {
			t.Errorf("%+v: %v (output %q), want %q", r, err, out.String(), tc.want)
		}
	}
}

// TestRequestParams: a bare parameter count prints the table with the requested stage
// marked, and a recommendation for a given activation size.
func TestRequestParams(t *testing.T) {
	r := Request{Params: "350M", World: 8, Stage: 1, Recommend: true, Memory: "24GiB", EffectiveBatch: 32, ActivationBytes: "1.5MiB"}
	var out bytes.Buffer
	if err := r.Run(&out, nil, nil); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	if !strings.Contains(s, "SW: 350.0M parameters") || !strings.Contains(s, "HW: 8 rank(s)") || !strings.Contains(s, "*") {
		t.Errorf("table:\n%s", s)
	}
	r.Memory = ""
	out.Reset()
	if err := r.Run(&out, nil, nil); err == nil || !strings.Contains(err.Error(), "--recommend needs --memory") || !strings.Contains(out.String(), "per device") {
		t.Errorf("no --memory: %v, after the table? %q", err, out.String())
	}
}
