//go:build !unix

package tcpnet

import "time"

func cpuTime() time.Duration { return 0 }
