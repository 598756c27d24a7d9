package trainer

import (
	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/progress"
	"github.com/qvd/qvd/model"
)

// The trainer's interfaces are satisfied implicitly by types in packages the trainer must not
// import (engine, model, the sinks): these assertions keep them honest. They live in a test
// because the import runs the other way.
var (
	_ Model                = (*engine.Net)(nil)
	_ DeviceStepper        = (*engine.Net)(nil)
	_ ParamSyncer          = (*engine.Net)(nil)
	_ CacheReleaser        = (*engine.Net)(nil)
	_ DeviceMemoryReporter = (*engine.Net)(nil)
	_ DropoutSeeder        = (*engine.Net)(nil)

	_ Model = (*model.Net)(nil)

	_ MetricsSink  = (*metrics.Writer)(nil)
	_ ProgressSink = (*progress.Line)(nil)
)
