package half

import (
	"encoding/json"
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/x448/float16"
)

func TestParseFormat(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Format
	}{
		{"fp32", FP32}, {"float32", FP32}, {"fp16", FP16}, {"float16", FP16}, {"half", FP16},
		{"bf16", BF16}, {"bfloat16", BF16}, {" BF16 ", BF16}, {"FP16", FP16},
	} {
		got, err := ParseFormat(c.in)
		if err != nil || got != c.want {
			t.Errorf("ParseFormat(%q) = %v, %v; want %v", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{"", "fp8", "int8", "float64"} {
		_, err := ParseFormat(in)
		if !errors.Is(err, ErrUnknownFormat) {
			t.Errorf("ParseFormat(%q) error = %v, want ErrUnknownFormat", in, err)
			continue
		}
		for _, name := range []string{"fp32", "fp16", "bf16"} {
			if !strings.Contains(err.Error(), name) {
				t.Errorf("ParseFormat(%q) error %q does not list %s", in, err, name)
			}
		}
	}
}

func TestFormatProperties(t *testing.T) {
	for _, c := range []struct {
		f     Format
		name  string
		bytes int
		max   float32
	}{
		{FP32, "fp32", 4, math.MaxFloat32},
		{FP16, "fp16", 2, float16.Frombits(0x7bff).Float32()},
		{BF16, "bf16", 2, math.Float32frombits(0x7f7f0000)},
	} {
		if c.f.String() != c.name || c.f.Bytes() != c.bytes || c.f.MaxFinite() != c.max {
			t.Errorf("%d: got %q %d %g, want %q %d %g", c.f, c.f.String(), c.f.Bytes(), c.f.MaxFinite(), c.name, c.bytes, c.max)
		}
		if back, err := ParseFormat(c.f.String()); err != nil || back != c.f {
			t.Errorf("ParseFormat(%v.String()) = %v, %v", c.f, back, err)
		}
		// MaxFinite is a value of the format.
		if r := c.f.Round(c.max); r != c.max {
			t.Errorf("%v.Round(MaxFinite) = %g", c.f, r)
		}
	}
	if got := FP16.Round(65520); !math.IsInf(float64(got), 1) {
		t.Errorf("FP16.Round(65520) = %g, want +Inf", got)
	}
	if s := Format(9).String(); s != "Format(9)" {
		t.Errorf("Format(9).String() = %q", s)
	}
	if Format(9).Bytes() != 0 || Format(9).Round(1.1) != 1.1 {
		t.Error("unknown Format: want Bytes 0 and identity Round")
	}
}

func TestFormatText(t *testing.T) {
	var cfg struct {
		Precision Format `json:"precision"`
	}
	if err := json.Unmarshal([]byte(`{"precision":"bfloat16"}`), &cfg); err != nil || cfg.Precision != BF16 {
		t.Fatalf("unmarshal bfloat16: %v, %v", cfg.Precision, err)
	}
	out, err := json.Marshal(cfg)
	if err != nil || string(out) != `{"precision":"bf16"}` {
		t.Fatalf("marshal: %s, %v", out, err)
	}
	if err := json.Unmarshal([]byte(`{"precision":"fp8"}`), &cfg); !errors.Is(err, ErrUnknownFormat) {
		t.Fatalf("unmarshal fp8: %v, want ErrUnknownFormat", err)
	}
	if _, err := Format(7).MarshalText(); !errors.Is(err, ErrUnknownFormat) {
		t.Fatalf("marshal Format(7): %v, want ErrUnknownFormat", err)
	}
}
