package optim

import (
	"math"
	"sort"
)

// Block-wise dynamic 8-bit quantisation (Dettmers, Lewis, Shleifer & Zettlemoyer, "8-bit
// Optimizers via Block-wise Quantization", ICLR 2022).
//
// A buffer is cut into blocks of QuantBlock elements, counted from the start of the
// optimizer's own buffer (a ZeRO shard is quantised independently of the other ranks'). Each
// block keeps a scale, its largest magnitude (absmax), as a float32 and each element as a
// one-byte code into a fixed table of 256 values in [-1, 1]; an element is decoded as
// table[code]*absmax.
//
// The tables are the paper's dynamic tree maps: a value's magnitude is taken as a decade
// 10^-k (k = 0..6; which one the code's leading zeros tell) times a linear fraction in
// (0.1, 1], and the bits left over after the decade go to the fraction, so that large values
// get fine steps and values down to 1e-7 of absmax are still told apart from zero. Decade
// 10^(d-6), d = 0..6, is split into 2^(d+s) equal bins, each represented by its midpoint:
//
//   - signed (Adam's first moment): s = 0, 1+2+...+64 = 127 magnitudes per sign, plus 0 and
//     +1, 256 codes. -1 is not representable; the most negative code is -0.993, so a block
//     whose largest magnitude is negative is scaled by that magnitude/0.993 (signedScale), so
//     that it is coded exactly too: quantising a decoded block again gives back its codes.
//   - unsigned (the second moment, never negative): the sign bit is one more fraction bit,
//     s = 1, 2+4+...+128 = 254 magnitudes, plus 0 and 1.
//
// In both tables the codes are sorted by value: code 0 is the most negative (signed) or zero
// (unsigned).

// QuantBlock is the number of elements that share one float32 absmax. The paper uses 2048; we
// use 256. A smaller block confines an outlier's coarse scale to fewer neighbours, which
// matters most for the second moment: its values span the square of the gradients' range, and
// an element far below its block's absmax falls into the map's coarse lowest decades. Small
// models and ZeRO shards also have few blocks to spread outliers over. The cost is one float32
// per 256 codes, 1/64 of the 8-bit state: 2.03125 bytes per parameter for Adam's two moments
// instead of 8, a 74.6% saving (2.0039 and 74.95% with 2048). A block of decoded float32
// moments (2 KiB) also fits on the goroutine stack, so Step allocates nothing.
const QuantBlock = 256

// QuantizedStateBytes is the memory of `moments` block-wise 8-bit state buffers over n
// elements: one byte per element each, and a float32 absmax per block of QuantBlock.
func QuantizedStateBytes(moments int, n int64) int64 {
	blocks := (n + QuantBlock - 1) / QuantBlock
	return int64(moments) * (n + 4*blocks)
}

// The quantiser finds the nearest code from the bits of a non-negative float32: the bucket of
// a is its exponent and top 8 mantissa bits, a relative width of at most 2^-8 (0.4%), while
// consecutive magnitudes of either map (and so the decision thresholds between them) are at
// least 0.7% apart (the finest bins, 0.9/128 wide, just below 1). A bucket therefore holds at
// most one threshold, and quantising takes one table look-up and one comparison
// (TestQuantTablesNearest checks the encoders against a binary search). Below 2^-24 (6e-8,
// under half the smallest non-zero magnitude of either map) every value is nearest to 0, so
// the table starts there: 24 binades of 256 buckets, 6 KiB per map.
const (
	quantBucketShift = 15
	quantFirstBucket = 0x33800000 >> quantBucketShift // the bits of 2^-24
	quantBuckets     = 0x3F800000>>quantBucketShift - quantFirstBucket + 1
)

// quantMap is one dynamic map with its nearest-value quantiser for magnitudes in [0, 1]. The
// arrays are sized 256 so that indexing them with a uint8 needs no bounds check.
type quantMap struct {
	decode [256]float32 // value of each code, ascending
	// mag[:n] are the representable magnitudes, ascending from 0 to 1; thr[i] is the decision
	// threshold between mag[i] and mag[i+1] (their midpoint), +Inf from n-1 on.
	mag, thr [256]float32
	n        int
	// up[i] is the threshold the encoder compares against to move from index i to i+1: thr,
	// except that the unsigned map's up[0] is 0, so that no positive value is coded as 0
	// (see encodeUnsigned).
	up [256]float32
	// bucket[b] is the index into mag nearest to the smallest float of bucket b; a bucket
	// below the first or above the last (a rounding of x/absmax just over 1, NaN) is clamped.
	bucket [quantBuckets]uint8
}

var (
	signedMap   = newQuantMap(true)
	unsignedMap = newQuantMap(false)
)

// dynamicMagnitudes are the non-zero magnitudes of the dynamic tree map below 1, ascending:
// 127 for the signed map, 254 for the unsigned one.
func dynamicMagnitudes(signed bool) []float64 {
	extra := 1
	if signed {
		extra = 0
	}
	var out []float64
	for d := 0; d <= 6; d++ {
		bins := 1 << (d + extra)
		scale := math.Pow(10, float64(d-6))
		for j := 0; j < bins; j++ {
			out = append(out, scale*(0.1+(float64(j)+0.5)*0.9/float64(bins)))
		}
	}
	return out
}

func newQuantMap(signed bool) *quantMap {
	q := &quantMap{}
	mags := append(append([]float64{0}, dynamicMagnitudes(signed)...), 1)
	q.n = len(mags)
	for i, m := range mags {
		q.mag[i] = float32(m)
	}
	for i := range q.thr {
		q.thr[i] = float32(math.Inf(1))
		if i+1 < q.n {
			q.thr[i] = float32((mags[i] + mags[i+1]) / 2)
		}
	}
	q.up = q.thr
	if !signed {
		q.up[0] = 0
	}
	if signed {
		// codes 0..126: -mag[127]..-mag[1]; 127: 0; 128..255: mag[1]..mag[128] (= 1)
		for c := 0; c < 256; c++ {
			if c < 127 {
				q.decode[c] = -q.mag[127-c]
			} else {
				q.decode[c] = q.mag[c-127]
			}
		}
	} else {
		q.decode = q.mag
	}
	for b := range q.bucket {
		q.bucket[b] = uint8(q.nearestSlow(math.Float32frombits(uint32(b+quantFirstBucket) << quantBucketShift)))
	}
	return q
}

// nearestSlow is the index of the magnitude nearest to a in [0, 1] by binary search over the
// thresholds: the reference the bucket table is built from and tested against.
func (q *quantMap) nearestSlow(a float32) int {
	return sort.Search(q.n, func(i int) bool { return a <= q.thr[i] })
}

// encodeSigned sets codes to the signed map's codes of x*inv (x/absmax), without branches: the
// magnitude's index c goes to code 127+c, or for a negative value 127-c with c clamped to 127
// (-1 is not in the map; signedScale makes the most negative value of a block -0.993). The
// look-up is written out in the loop rather than called, which halves its cost.
func encodeSigned(codes []uint8, x []float32, inv float32) {
	codes = codes[:len(x)]
	q := signedMap
	for i, v := range x {
		bits := math.Float32bits(float32(v * inv))
		neg := int(bits >> 31)
		a := bits &^ (1 << 31)
		c := q.bucket[min(max(int(a>>quantBucketShift)-quantFirstBucket, 0), quantBuckets-1)]
		var up uint8
		if math.Float32frombits(a) > q.up[c] {
			up = 1
		}
		ci := min(int(c+up), 128-neg)
		codes[i] = uint8(127 + ci - 2*neg*ci)
	}
}

// encodeUnsigned sets codes to the unsigned map's codes of x*inv >= 0. A positive value is
// never coded as 0: Adam divides by sqrt(v), and a second moment rounded to zero under a
// first moment that is not would turn a tiny update into one of size lr*m/eps. The smallest
// code (3.25e-7 of absmax) over-estimates such a v instead, which can only shorten the step.
func encodeUnsigned(codes []uint8, x []float32, inv float32) {
	codes = codes[:len(x)]
	q := unsignedMap
	for i, v := range x {
		a := float32(v * inv)
		bits := math.Float32bits(a)
		c := q.bucket[min(max(int(bits>>quantBucketShift)-quantFirstBucket, 0), quantBuckets-1)]
		var up uint8
		if a > q.up[c] {
			up = 1
		}
		codes[i] = c + up
	}
}

// signedScale is the absmax of a signed block whose largest element is maxPos and whose most
// negative is -maxNeg: the most negative code is -0.993, not -1 (see above).
func signedScale(maxPos, maxNeg float32) float32 {
	return max(maxPos, maxNeg/signedMinMag)
}

// signedMinMag is the magnitude of the signed map's most negative value.
var signedMinMag = -signedMap.decode[0]

// invAbsmax is 1/absmax, or 0 for an all-zero block (whose codes then all decode to 0).
func invAbsmax(absmax float32) float32 {
	if absmax > 0 {
		return 1 / absmax
	}
	return 0
}

// quantizeBlock sets codes from x with a new absmax, which it returns: the signed map for a
// first moment, the unsigned one (x >= 0) for a second.
func quantizeBlock(codes []uint8, x []float32, signed bool) float32 {
	codes = codes[:len(x)]
	var hi, lo float32
	for _, v := range x {
		hi, lo = max(hi, v), min(lo, v)
	}
	absmax := hi
	if signed {
		absmax = signedScale(hi, -lo)
	}
	if signed {
		encodeSigned(codes, x, invAbsmax(absmax))
	} else {
		encodeUnsigned(codes, x, invAbsmax(absmax))
	}
	return absmax
}

// dequantizeBlock writes the values codes and absmax stand for into x.
func dequantizeBlock(x []float32, codes []uint8, absmax float32, signed bool) {
	q := unsignedMap
	if signed {
		q = signedMap
	}
	codes = codes[:len(x)]
	for i, c := range codes {
		x[i] = q.decode[c] * absmax
	}
}
