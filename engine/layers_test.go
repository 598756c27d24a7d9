//go:build !cuda

package engine_test

import (
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cpu"
	"github.com/qvd/qvd/engine/enginetest"
)

// Every native layer's forward and backward pass, on the reference device and the CPU
// backend, against gorgonia's symbolic differentiation and finite differences (gorgonia is
// not part of cuda builds; engine/cuda runs the conformance suite against the reference).
func TestLayerGradients(t *testing.T) {
	t.Run("reference", func(t *testing.T) {
		enginetest.TestLayerGradients(t, func() engine.Device { return engine.NewReference() })
	})
	t.Run("cpu", func(t *testing.T) {
		enginetest.TestLayerGradients(t, func() engine.Device { return cpu.New(cpu.Options{Threads: 2}) })
	})
}
