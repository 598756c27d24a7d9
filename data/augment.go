package data

import (
	"fmt"
	"math/rand/v2"
)

// MaxCropPadding bounds AugmentConfig.CropPadding: the usual values are 2 to 4 pixels (4 for
// CIFAR-10's 32×32); a larger one mostly shows the network padding.
const MaxCropPadding = 64

// AugmentConfig is data.augment: random transformations of the training samples, drawn
// afresh for every sample of every epoch. Evaluation never augments.
type AugmentConfig struct {
	// CropPadding pads the image with this many zero pixels on every side and crops a random
	// window of the original size back out (torchvision's RandomCrop(size, padding)); 0 is
	// off.
	CropPadding int `yaml:"crop_padding" json:"crop_padding"`
	// HFlip mirrors the image left to right with probability 1/2.
	HFlip bool `yaml:"hflip" json:"hflip"`
}

// Enabled reports whether any transformation is on.
func (a AugmentConfig) Enabled() bool { return a.CropPadding > 0 || a.HFlip }

// Validate checks the fields; errors name the field by its YAML name.
func (a AugmentConfig) Validate() error {
	if a.CropPadding < 0 || a.CropPadding > MaxCropPadding {
		return fmt.Errorf("crop_padding: must be in [0, %d] (0 = off), got %d", MaxCropPadding, a.CropPadding)
	}
	return nil
}

// Draw places a training fill in the run, so augmentation can draw its randomness from (run
// seed, epoch, sample index) alone: the same sample in the same epoch is transformed the same
// way whichever rank reads it, whatever the number of ranks, and after a resume.
type Draw struct {
	Seed  uint64
	Epoch int
}

// augmentSalt separates augmentation's random stream from Permutation's, which is seeded
// with the same run seed.
const augmentSalt = 0x61756760_00000001 // "aug`" + 1

// transform is one sample's draw: the crop window's offset in the padded image and the flip.
type transform struct {
	dy, dx int
	flip   bool
}

// draw returns the transformation of sample i in the epoch of at.
func (a AugmentConfig) draw(at Draw, i int) transform {
	var src rand.PCG
	src.Seed(at.Seed^augmentSalt, mix64(mix64(uint64(at.Epoch))^uint64(i)))
	var t transform
	if a.CropPadding > 0 {
		span := uint64(2*a.CropPadding + 1)
		t.dy, t.dx = int(uint64n(&src, span)), int(uint64n(&src, span))
	}
	if a.HFlip {
		t.flip = src.Uint64()>>63 == 1
	}
	return t
}

// apply writes src transformed into dst; both hold c×h×w values, planar. Pixels the crop
// takes from the padding are 0 (black, as torchvision pads with fill 0 before normalising).
func apply[T uint8 | float32](dst, src []T, c, h, w, pad int, t transform) {
	oy, ox := t.dy-pad, t.dx-pad // dst (y, x) comes from src (y+oy, x+ox)
	for ch := range c {
		plane, out := src[ch*h*w:][:h*w], dst[ch*h*w:][:h*w]
		for y := range h {
			row := out[y*w:][:w]
			sy := y + oy
			if sy < 0 || sy >= h {
				clear(row)
				continue
			}
			in := plane[sy*w:][:w]
			for x := range w {
				sx := x + ox
				if t.flip {
					sx = w - 1 - x + ox
				}
				if sx < 0 || sx >= w {
					row[x] = 0
				} else {
					row[x] = in[sx]
				}
			}
		}
	}
}
