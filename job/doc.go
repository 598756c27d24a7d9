// Package job runs one process's part of a training job: Run takes a resolved
// configs.Config and Options and owns everything between the command line and the trainer —
// the log and progress line, the cluster member (gossip, gRPC, the data plane: shared
// memory, TCP, gRPC, hierarchical or NCCL) and its peer watch, the engine on its device, the
// data, init_from and resume, the memory limit, the metrics sinks (metrics.jsonl, Prometheus,
// TensorBoard/CSV, the dashboard and the cluster's gossip) — and returns the trainer's Result
// and an error. It prints only what a user of `qvd train` reads on stdout (rank 0's summary)
// and logs through zap; it never exits the process nor reads its environment or flags (the
// caller passes Options.LookupEnv and MemberOptions.Getenv).
//
// Who calls it: cmd/qvd (`qvd train`, `qvd join`, and the workers of `qvd launch`, SLURM and
// torchrun), and tests, which run whole groups in one process through Options.Comm (an
// in-process communicator, collective.NewInproc). The pieces a caller needs before Run are
// exported too: ResolveAutoMicro (train.micro_batch: auto, while the config is resolved),
// StartMember and AwaitJob (a worker joins before it has a config), LoadClusterKey and
// LoadTLS. The other commands that join a cluster have their entry points here too: Bench
// (one rank of `qvd bench`), Status and ServeDashboard (observers, for `qvd status` and
// `qvd dashboard`).
//
// Devices: openDevice is the one place a device is chosen — the CPU backend (CPUDevice, cgo),
// or a backend of engine's registry (engine.Register: the reference device, and cuda when a
// binary built with -tags cuda links engine/cuda through this package). NCCL comes with the
// same build tag (NCCLOver); there is no other registration.
//
// Concurrency: Run may be called from several goroutines at once (one per rank of an
// in-process group). The settings it changes for a run — the GC percent (unless GOGC is
// set), the Go memory limit (memory.limit), the gorgonia engine's BLAS threads — are the
// process's: such Runs share them, and each Run puts back the GC percent and the memory limit
// it found when it returns.
// Errors of configuration are configs.ErrInvalid.
//
// It must not import cmd/qvd; it imports job/estimate, never the reverse.
package job
