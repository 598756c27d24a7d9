// Package bench measures a collective.Communicator the way nccl-tests does: for each buffer
// size, out of place and in place, the time per call, the algorithm bandwidth (bytes / time)
// and the bus bandwidth (what each link carries: algbw × the collective's factor, comparable
// across group sizes), and every element of every result checked against exact integer
// inputs, so a bandwidth is only reported for right answers.
//
// Run is one rank's part; the caller starts the ranks and builds their communicator. It must
// not import cmd/qvd, job or the cluster package (it measures whatever Communicator it is given).
package bench
