package vec

import (
	"math"

	"github.com/qvd/qvd/internal/half"
)

// roundBlock is the number of elements Round converts at a time through a stack buffer: 8 KiB
// of 16-bit words stays in L1 between the encode and the decode pass.
const roundBlock = 4096

// Round replaces every x[i] by its value after a round trip through format f (identity for
// half.FP32), bit-identical to f.Round, using the vector conversions: the working-precision
// rounding of weights and gradients, and the collectives' rounding of a reduced shard before
// it is gathered, run over whole buffers every step.
func Round(x []float32, f half.Format) {
	var tmp [roundBlock]uint16
	switch f {
	case half.FP16:
		for len(x) > 0 {
			n := min(len(x), roundBlock)
			encodeF16(tmp[:n], x[:n])
			decodeF16(x[:n], tmp[:n])
			x = x[n:]
		}
	case half.BF16:
		for len(x) > 0 {
			n := min(len(x), roundBlock)
			encodeBF16(tmp[:n], x[:n])
			for i, w := range tmp[:n] {
				x[i] = math.Float32frombits(uint32(w) << 16)
			}
			x = x[n:]
		}
	}
}
