package enginetest

import (
	"math"
	"testing"

	"github.com/qvd/qvd/engine"
)

// TestMemory checks Malloc, Release and the views it returns.
func TestMemory(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	if h.d.Name() == "" {
		t.Error("Name is empty")
	}
	_ = h.d.TotalMemory()
	for _, dt := range append(FloatTypes, engine.I32) {
		b, err := h.d.Malloc(100, dt)
		if err != nil {
			t.Fatalf("malloc of 100 %v: %v", dt, err)
		}
		if !b.Valid() || b.N != 100 || b.T != dt || b.Off != 0 {
			t.Errorf("malloc of 100 %v returned %+v", dt, b)
		}
		h.d.Release(b)
	}
	for _, bad := range []struct {
		n  int
		dt engine.DType
	}{{-1, engine.F32}, {4, 0}, {4, engine.DType(99)}} {
		if b, err := h.d.Malloc(bad.n, bad.dt); err == nil {
			t.Errorf("malloc of %d %v succeeded: %+v", bad.n, bad.dt, b)
			h.d.Release(b)
		}
	}
	// Many live allocations are distinct memory; releasing some leaves the others intact.
	const count = 40
	bufs := make([]engine.Buf, count)
	for i := range bufs {
		dt := append(FloatTypes, engine.I32)[i%4]
		bufs[i] = h.alloc(1+i*37, dt)
		h.d.Fill(bufs[i], float32(i))
	}
	for i := 0; i < count; i += 3 {
		h.d.Release(h.allocs[i].whole)
	}
	kept := h.allocs[:0]
	for i, a := range h.allocs {
		if i%3 != 0 {
			kept = append(kept, a)
		}
	}
	h.allocs = kept
	for i := 1; i < count; i++ {
		if i%3 == 0 {
			continue
		}
		got := h.get(bufs[i])
		for j, v := range got {
			if v != float32(i) {
				t.Fatalf("allocation %d (%d %v): element %d is %v, want %v", i, bufs[i].N, bufs[i].T, j, v, float32(i))
			}
		}
	}
	// Released memory can be allocated again.
	for range 50 {
		b, err := h.d.Malloc(1<<16, engine.F32)
		if err != nil {
			t.Fatal(err)
		}
		h.d.Fill(b, 1)
		h.d.Release(b)
	}
	h.sync("fill and release")
}

// specials are values whose rounding to the half types is worth checking one by one.
var specials = []float32{
	0, float32(math.Copysign(0, -1)), 1, -1, 0.1, -2.5, 3.14159265, 1.0 / 3,
	65504, 65519, 65520, 70000, -1e6, 1e30, 3e38, // F16's largest finite value, its rounding edge, overflow
	6e-5, 6.1e-5, 5.96e-8, 2.98e-8, 2.9e-8, 1e-8, 1e-20, 1e-40, // F16 subnormals and underflow; f32 subnormal
	math.Float32frombits(0x3f808000), math.Float32frombits(0x3f818000), // BF16 ties to even
	math.Float32frombits(0x3f808001), math.Float32frombits(0x3f7fffff),
	math.Float32frombits(0x3c001000), math.Float32frombits(0x3c003000), // F16 ties (1 + 2⁻¹¹, 1 + 3·2⁻¹¹ at 2⁻⁷)
	float32(math.Inf(1)), float32(math.Inf(-1)), float32(math.NaN()),
}

// TestUploadDownload checks that Upload rounds to the buffer's type (to nearest even),
// Download returns what the buffer holds, and both respect views.
func TestUploadDownload(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, n := range []int{1, len(specials), 17, 4099} {
			vals := specials
			if n != len(specials) {
				vals = h.normal(n, 10)
			}
			b := h.alloc(len(vals), dt)
			got := h.put(b, vals)
			want := make([]float32, len(vals))
			for i, v := range vals {
				want[i] = roundTo(dt, v)
			}
			h.exact(dt.String()+" upload", got, want)
		}
		// A view of part of a buffer: only it changes.
		b, _ := h.filled(64, dt, 2)
		h.d.Upload(b.Slice(10, 20), h.normal(10, 1))
		h.d.Upload(b.Slice(20, 20), nil)
		got := h.get(b)
		for i, v := range got {
			if (i < 10 || i >= 20) && v != 2 {
				t.Errorf("%v: upload into [10, 20) changed element %d to %v", dt, i, v)
			}
		}
		part := make([]float32, 10)
		if err := h.d.Download(part, b.Slice(10, 20)); err != nil {
			t.Fatal(err)
		}
		h.exact(dt.String()+" download of a view", part, got[10:20])
	}
	ints := []int32{0, 1, -1, 7, -123456, 1 << 24, -(1 << 24), 99}
	b := h.alloc(len(ints), engine.I32)
	h.d.UploadInt32(b, ints)
	got := h.get(b)
	want := make([]float32, len(ints))
	for i, v := range ints {
		want[i] = float32(v)
	}
	h.exact("i32 upload", got, want)
}

// TestFill checks Fill for every type, rounding the value to the buffer's type.
func TestFill(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, dt := range FloatTypes {
		for _, v := range []float32{0, -1.5, 0.1, 70000, 1e-9, float32(math.NaN()), float32(math.Inf(-1))} {
			for _, n := range []int{1, 33, 5000} {
				b, got := h.filled(n, dt, v)
				want := make([]float32, b.N)
				for i := range want {
					want[i] = roundTo(dt, v)
				}
				h.exact(dt.String()+" fill", got, want)
			}
		}
	}
	for _, v := range []float32{0, 7, -3, 1 << 20} {
		_, got := h.filled(9, engine.I32, v)
		for i, g := range got {
			if g != v {
				t.Errorf("i32 fill with %v: element %d is %v", v, i, g)
			}
		}
	}
	b, _ := h.filled(30, engine.F32, 1)
	h.d.Fill(b.Slice(5, 25), 3)
	got := h.get(b)
	for i, v := range got {
		want := float32(1)
		if i >= 5 && i < 25 {
			want = 3
		}
		if v != want {
			t.Errorf("fill of [5, 25): element %d is %v, want %v", i, v, want)
		}
	}
}

// TestCopy checks Copy between every pair of floating-point types: one rounding to the
// destination's type.
func TestCopy(t *testing.T, newDevice NewDevice) {
	h := newHarness(t, newDevice)
	for _, st := range FloatTypes {
		for _, dt := range FloatTypes {
			vals := append(h.normal(1000, 3), specials...)
			for i := range 50 {
				vals[i] *= 1e5 // beyond F16's range
			}
			src := h.alloc(len(vals), st)
			sv := h.put(src, vals)
			dst := h.alloc(len(vals), dt)
			h.d.Upload(dst, nans(len(vals)))
			h.d.Copy(dst, src)
			want := make([]float32, len(sv))
			for i, v := range sv {
				want[i] = roundTo(dt, v)
			}
			h.exact(st.String()+" to "+dt.String()+" copy", h.get(dst), want)
			// Views: copy [100, 200) of src into [300, 400) of dst.
			h.d.Fill(dst, 0)
			h.d.Copy(dst.Slice(300, 400), src.Slice(100, 200))
			got := h.get(dst)
			for i := range got {
				w := float32(0)
				if i >= 300 && i < 400 {
					w = want[i-200]
				}
				if !same(got[i], w) {
					t.Errorf("%v to %v copy of a view: element %d is %v, want %v", st, dt, i, got[i], w)
					break
				}
			}
		}
	}
}
