// Package launch places and supervises the processes of a qvd job on one machine or many:
//
//   - Run starts local worker processes, relays their output with the rank in front, stops
//     them all when one fails or the caller's context ends, and reports the first cause of a
//     failure (a rank that hung, was stopped or died), not merely the first exit; RunElastic
//     lets an elastic job's survivors go on without a failed worker (Elastic.MinAlive) or
//     starts it again as a worker that joins the running job through a live one
//     (Elastic.MaxRestarts, torchrun's --max-restarts);
//   - Nodes places a multi-machine launch the way torchrun's static rendezvous does
//     (--nnodes, --node-rank, --master-addr, --master-port), and Prepare gives the workers
//     their environment (a fresh cluster key, their share of the cores); Train and Bench
//     build the command lines of `qvd launch`'s and `qvd bench`'s workers, and
//     ResumeCommand the line that resumes an interrupted run;
//   - FromEnv maps the environment a SLURM step or a torchrun-style launcher (torchrun,
//     Kubeflow's PyTorchJob) gives a process to its role, address and name in the job, so
//     `qvd train` needs no wrapper script there.
//
// The planners are pure functions of a getenv function and are driven by table tests; name
// resolution, /proc and processes are at the edges. The package reads no flags and never
// exits the process; the caller sets process-wide state (GOMAXPROCS, BLAS threads) from what
// it returns. It must not import cmd/qvd or the job package.
package launch
