package estimate

import (
	"fmt"
	"runtime"

	"github.com/qvd/qvd/configs"
	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/model"
)

// PerSample measures the activation memory of one sample of spec on the engine a config
// names, and says how: on the native engine, its allocator's growth between two micro-batches
// (evaluation batch 1) on the CPU backend open gives; on gorgonia, the Go heap's
// (MeasureActivationBytes).
func PerSample(spec *model.Spec, engineName string, f half.Format, open OpenDevice) (perSample int64, source string, err error) {
	if engineName != configs.EngineNative {
		perSample, err = MeasureActivationBytes(spec, f)
		return perSample, "measured on the gorgonia engine", err
	}
	var a, b int64
	if a, err = MeasurePeakActivations(open, spec, f, 8, 1); err == nil {
		b, err = MeasurePeakActivations(open, spec, f, 40, 1)
	}
	return (b - a) / 32, "measured on the native engine", err
}

// MeasureActivationBytes measures the heap a training graph holds per sample: the graph is
// built and run at two micro-batch sizes and the difference divided by the difference in
// samples, so what does not grow with the batch (weights, gradients, graph structure) cancels.
func MeasureActivationBytes(spec *model.Spec, f half.Format) (int64, error) {
	layout := model.NewLayout(spec)
	params := make([]float32, layout.Size)
	model.Init(spec, layout, params, 1)
	grads := make([]float32, layout.Size)
	at := func(micro int) (int64, error) {
		before := HeapInUse()
		after, err := HeapAfterStep(spec, layout, params, grads, f, micro)
		return after - before, err
	}
	const small, large = 8, 72
	if _, err := at(small); err != nil { // one-time allocations (gorgonia's caches) land here
		return 0, err
	}
	a, err := at(small)
	if err != nil {
		return 0, err
	}
	b, err := at(large)
	if err != nil {
		return 0, err
	}
	per := (b - a) / (large - small)
	if per <= 0 {
		return 0, fmt.Errorf("no growth with the batch (%d bytes at %d samples, %d at %d); give --activation-bytes", a, small, b, large)
	}
	return per, nil
}

// HeapAfterStep builds the training graph at micro over params and runs one forward/backward
// of a blank batch into grads, and returns the Go heap in use (after a collection) while the
// graph is still alive.
func HeapAfterStep(spec *model.Spec, layout *model.Layout, params, grads []float32, f half.Format, micro int) (int64, error) {
	net, err := model.New(spec, layout, params, model.Options{MicroBatch: micro, EvalBatch: 1, Grad: f})
	if err != nil {
		return 0, err
	}
	defer net.Close()
	b := data.NewBatch(micro, SampleSize(spec))
	b.N = micro
	if _, err := net.ForwardBackward(b, 1, model.FlatSink(grads[layout.Frozen:])); err != nil {
		return 0, err
	}
	used := HeapInUse()
	runtime.KeepAlive(net)
	runtime.KeepAlive(b)
	return used, nil
}

// HeapInUse is the Go heap's live bytes after a collection.
func HeapInUse() int64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return int64(ms.HeapAlloc)
}

// SampleSize is the number of values in one input sample of spec.
func SampleSize(spec *model.Spec) int {
	n := 1
	for _, d := range spec.Input {
		n *= d
	}
	return n
}
