// Package trainer runs qvd's training loop on one rank of a data-parallel group: micro-batches
// with gradient accumulation, mixed precision with loss scaling, global-norm clipping, the LR
// schedule, the optimizer step, evaluation, checkpoints and resume, and adaptation to memory
// trouble.
// It sits in the training layer of docs/architecture.md: it must not import configs, job or
// cmd, nor any engine backend (the engine reaches it through Model, DeviceStepper and
// StepEngine).
//
// A step is collect → reduce → decide → apply (step.go): the micro-batches run through a
// StepEngine — the ZeRO engine on the host (hostStep) or the model's device (deviceStep, a
// DeviceStepper), chosen once in New — the gradient and the step's counters are reduced across
// the group, the pure decide (decide.go) turns the reduced statistics into the step's
// decision, and the decision is applied and then logged and recorded. The checkpoint format
// and its distributed save/resume protocol are package checkpoint/sharded's.
//
// Callers (package job) build a Trainer with New from a Setup and call Run; Abort
// is the only method safe to call from another goroutine while Run runs. Every rank of a
// group must make the same calls: the trainer's collectives run in the same order on every
// rank.
//
// It must not import engine, cmd or job: models reach it through the Model interface and
// its optional extensions (DeviceStepper, ParamSyncer, ...), asserted in assert_test.go.
package trainer
