// Package elastic is the pure core of elastic training: its configuration (the YAML
// section elastic) and the decisions a group takes when it loses members — whether to
// continue, wait or fail, which state to continue from, and the gradient accumulation that
// keeps the global batch at the new world size. It does no I/O and starts no goroutine:
// package job carries the decisions out (abort the step, re-rendezvous, rebuild the data
// plane and the trainer) and table tests drive it directly, as etcd's raft is driven.
//
// It is a leaf: it imports nothing of qvd's, and package job and configs import it.
package elastic
