package optim

import "fmt"

// StateElems is the optimizer state cfg's optimizer keeps per parameter, in buffers of Len()
// elements: 2 for adam, adamw and their 8-bit versions (exp_avg, exp_avg_sq), 1 for sgd with
// momentum (momentum_buffer), 0 for plain sgd. It is what ExportState returns, so memory
// estimates (zero.Spec.StateElems) count what the optimizers allocate; an unknown type is an
// error naming the accepted ones.
func StateElems(cfg Config) (int, error) {
	switch cfg.Type {
	case TypeAdam, TypeAdamW, TypeAdam8bit, TypeAdamW8bit:
		return 2, nil
	case TypeSGD:
		if cfg.Momentum != 0 {
			return 1, nil
		}
		return 0, nil
	}
	return 0, fmt.Errorf("type: unknown optimizer %q (want %s, %s, %s, %s or %s)", cfg.Type, TypeSGD, TypeAdam, TypeAdamW, TypeAdam8bit, TypeAdamW8bit)
}

// QuantizedState says cfg's optimizer keeps its state block-wise in 8 bits, so it occupies
// QuantizedStateBytes rather than 4 bytes an element.
func QuantizedState(cfg Config) bool {
	return cfg.Type == TypeAdam8bit || cfg.Type == TypeAdamW8bit
}
