// Package cluster gives qvd its membership, failure detection, rendezvous and the gRPC
// control plane.
//
// Owns: one memberlist (SWIM gossip, github.com/hashicorp/memberlist) per process, this
// node's metadata (Meta: version, role, job, gRPC and data-plane addresses, devices, memory,
// generation, rank, step), the control service registered on the process's gRPC server, and
// the gRPC authentication every qvd server and client uses (ServerOptions, DialOptions).
// The gRPC server itself, and the collectives registered on it, belong to the caller.
//
// Who calls it: package job, for the commands of cmd/qvd. For `qvd train --nodes N` it builds
// a Node with RoleCoordinator and calls Coordinate(ctx, job, N, config); for `qvd join PEER` a
// RoleWorker Node, Join(PEER) and AwaitRoster, taking the job's config from the roster; for
// `qvd status PEER` Status (cmd/qvd prints the members with FormatStatus). The job watches
// Events for Failed members (to abort collectives early, naming the lost rank), calls SetStep
// as training goes, and after a loss in an elastic job re-forms the group (Survivors, Reform).
//
// Failure detection: memberlist probes each member about once per probe interval; a member
// that answers neither direct nor indirect probes is suspected, and declared dead after the
// suspicion timeout unless it refutes. With the defaults (GossipConfig) a killed member is
// reported as Failed 5–6s after it dies (measured, 5 members; up to ~14s when no other
// member confirms the suspicion); the tests use timings scaled down 5× and see it in about
// 1.5s. A member that closes its Node tells its peers first and is reported as Left.
//
// Security: one cluster key (16/24/32 bytes) per cluster.
//   - Gossip is encrypted and authenticated with it (AES-GCM, memberlist's keyring, with
//     plaintext refused in both directions): a node without the key cannot join; its Join
//     fails with ErrKeyMismatch and the member it tried logs a warning naming its address.
//   - gRPC calls carry an HMAC of a timestamp and nonce under a key derived from it (see
//     auth.go): without TLS this authenticates callers but does not encrypt the traffic.
//   - Rosters are signed with a derived key and their data secret is sealed (AES-GCM), so
//     a roster cannot be forged and the secret is not readable on the wire.
//   - Optionally, mutual TLS (tls.go): Config.TLS, loaded from TLSConfig's files, puts every
//     gRPC connection in TLS 1.3 with both ends' certificates verified against the cluster's
//     private CA (ServerOptions, DialOptions); nodes advertise the CA's fingerprint and refuse
//     to merge with a node of another CA or without TLS (ErrTLSMismatch).
//
// The threat model, what is protected and what not, is in docs/security.md.
//
// Versions: members must run the same major.minor of qvd; a node of another version is
// refused on both sides of its join (ErrIncompatibleVersion on the joiner, a warning on the
// member) and is never admitted by gossip either.
//
// Concurrency: every Node method is safe for concurrent use. Node owns two goroutines (event
// delivery, step gossip) plus memberlist's; Close stops them all and is safe to call twice.
// Every call that talks to the network takes a context or is bounded by
// gossip.tcp_timeout.
package cluster
