//go:build cuda

package model

import (
	"errors"

	"github.com/qvd/qvd/data"
)

// ErrNoCPUEngine is New's error in a binary built with -tags cuda. gorgonia's own build tag is
// also called cuda and turns gorgonia into its cuDNN mode (which needs cudnn.h and links
// cuBLAS 11), so the gorgonia engine cannot be in that binary: it trains with the native
// engine (device.type cuda or cpu).
var ErrNoCPUEngine = errors.New("model: this qvd was built with -tags cuda, which leaves out the gorgonia engine (gorgonia's own cuda tag needs cuDNN): train with engine: native")

// Net is the gorgonia engine's type; in a -tags cuda build it cannot be made.
type Net struct{ spec *Spec }

// New fails with ErrNoCPUEngine in a -tags cuda build.
func New(spec *Spec, layout *Layout, params []float32, opt Options) (*Net, error) {
	return nil, ErrNoCPUEngine
}

func (n *Net) Spec() *Spec                                { return n.spec }
func (n *Net) Layout() *Layout                            { return nil }
func (n *Net) Params() []float32                          { return nil }
func (n *Net) MicroBatch() int                            { return 0 }
func (n *Net) EvalBatch() int                             { return 0 }
func (n *Net) Close() error                               { return nil }
func (n *Net) Evaluate(b *data.Batch) (EvalResult, error) { return EvalResult{}, ErrNoCPUEngine }
func (n *Net) ForwardBackward(*data.Batch, float32, GradSink) (float32, error) {
	return 0, ErrNoCPUEngine
}
