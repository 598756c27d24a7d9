package data

import (
	"image"
	"image/color"
	"math"
)

// planar writes img into dst as c planes (c = 1: grey, c = 3: R, G, B) of its own size,
// row-major: dst holds c × Dy × Dx bytes. Grey is the standard library's conversion
// (color.GrayModel: ITU-R BT.601 luma), so an 8-bit grey PNG comes back byte for byte. Alpha
// is ignored: the colour channels are taken un-premultiplied as stored.
func planar(dst []uint8, img image.Image, c int) {
	b := img.Bounds()
	h, w := b.Dy(), b.Dx()
	switch m := img.(type) {
	case *image.Gray:
		if c == 1 {
			for y := range h {
				copy(dst[y*w:][:w], m.Pix[m.PixOffset(b.Min.X, b.Min.Y+y):][:w])
			}
			return
		}
		for y := range h {
			row := m.Pix[m.PixOffset(b.Min.X, b.Min.Y+y):][:w]
			for ch := range c {
				copy(dst[ch*h*w+y*w:][:w], row)
			}
		}
		return
	case *image.NRGBA:
		if c == 3 {
			for y := range h {
				row := m.Pix[m.PixOffset(b.Min.X, b.Min.Y+y):][:4*w]
				for x := range w {
					dst[y*w+x], dst[h*w+y*w+x], dst[2*h*w+y*w+x] = row[4*x], row[4*x+1], row[4*x+2]
				}
			}
			return
		}
	}
	for y := range h {
		for x := range w {
			px := img.At(b.Min.X+x, b.Min.Y+y)
			if c == 1 {
				dst[y*w+x] = color.GrayModel.Convert(px).(color.Gray).Y
				continue
			}
			n := color.NRGBAModel.Convert(px).(color.NRGBA)
			dst[y*w+x], dst[h*w+y*w+x], dst[2*h*w+y*w+x] = n.R, n.G, n.B
		}
	}
}

// resizeBilinear resamples c planes of sh × sw bytes in src to dh × dw in dst with bilinear
// interpolation on pixel centres (align_corners=False: PIL's and torchvision's convention,
// where source coordinate = (dst + 0.5) × scale − 0.5, clamped to the image), rounding to the
// nearest byte. Downscaling by more than 2× aliases, as plain bilinear does everywhere; it
// is meant for modest size changes. Equal sizes copy.
func resizeBilinear(dst, src []uint8, c, sh, sw, dh, dw int) {
	if sh == dh && sw == dw {
		copy(dst, src[:c*sh*sw])
		return
	}
	sy := float64(sh) / float64(dh)
	sx := float64(sw) / float64(dw)
	for ch := range c {
		in, out := src[ch*sh*sw:][:sh*sw], dst[ch*dh*dw:][:dh*dw]
		for y := range dh {
			y0, y1, fy := axis(y, sy, sh)
			for x := range dw {
				x0, x1, fx := axis(x, sx, sw)
				top := float64(in[y0*sw+x0])*(1-fx) + float64(in[y0*sw+x1])*fx
				bot := float64(in[y1*sw+x0])*(1-fx) + float64(in[y1*sw+x1])*fx
				v := top*(1-fy) + bot*fy
				out[y*dw+x] = uint8(math.Min(255, math.Max(0, math.Round(v))))
			}
		}
	}
}

// axis maps output coordinate i to its two source neighbours and the weight of the second.
func axis(i int, scale float64, n int) (lo, hi int, frac float64) {
	s := (float64(i)+0.5)*scale - 0.5
	if s < 0 {
		s = 0
	}
	lo = int(s)
	if lo >= n-1 {
		return n - 1, n - 1, 0
	}
	return lo, lo + 1, s - float64(lo)
}
