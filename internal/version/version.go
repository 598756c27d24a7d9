// Package version holds qvd's version string, recorded in checkpoints and logs, and later
// compared between cluster members.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
package version

// Version is qvd's release version; a build may override it with
// -ldflags "-X github.com/qvd/qvd/internal/version.Version=...".
var Version = "0.1.0-dev"
