//go:build !linux

package shmnet

import (
	"context"

	"go.uber.org/zap"

	"github.com/qvd/qvd/collective"
)

// New needs Linux: elsewhere it reports why not.
func New(context.Context, Group, Config, *zap.Logger) (collective.Transport, error) {
	return nil, errUnsupported
}

// Available reports that shared memory cannot be used off Linux.
func Available(string) error { return errUnsupported }
