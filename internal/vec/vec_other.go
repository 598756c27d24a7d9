//go:build !amd64 || purego

package vec

// Without the amd64 kernels (another architecture, or the purego tag) every function is its
// plain Go loop.

func add(dst, src []float32)                     { addGeneric(dst, src) }
func addScale(dst, src []float32, s float32)     { addScaleGeneric(dst, src, s) }
func scale(x []float32, s float32)               { scaleGeneric(x, s) }
func maxInto(dst, src []float32)                 { maxGeneric(dst, src) }
func sumSquares(x []float32, p *[lanes]float64)  { sumSquaresGeneric(x, p) }
func encodeF16(dst []uint16, src []float32)      { encodeF16Generic(dst, src) }
func decodeF16(dst []float32, src []uint16)      { decodeF16Generic(dst, src) }
func addDecodedF16(dst []float32, src []uint16)  { addDecodedF16Generic(dst, src) }
func encodeBF16(dst []uint16, src []float32)     { encodeBF16Generic(dst, src) }
func addDecodedBF16(dst []float32, src []uint16) { addDecodedBF16Generic(dst, src) }
func accelerated() string                        { return "purego" }

func adamW(p, g, m, v []float32, c *AdamConsts)  { adamWGeneric(p, g, m, v, c) }
func adamL2(p, g, m, v []float32, c *AdamConsts) { adamL2Generic(p, g, m, v, c) }
