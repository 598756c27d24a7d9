package engine_test

import (
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/enginetest"
)

// The reference device passes the conformance suite every backend runs.
func TestReferenceConformance(t *testing.T) {
	enginetest.TestDevice(t, func() engine.Device { return engine.NewReference() })
}
