// Package cli is qvd's command-line machinery over the standard flag package: a command's
// help (synopsis, about, flags with placeholders, examples), the one-line handling of -h,
// and bash and zsh completion scripts generated from the same FlagSets that parse the
// arguments, so help and completion cannot drift from them.
//
// Who calls it: cmd/qvd, which owns the command table and maps outcomes to exit codes.
// It is foundation code: it imports no other qvd package and never exits the process.
package cli
