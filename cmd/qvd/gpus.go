package main

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/qvd/qvd/memory"
)

// cmdGPUs lists the GPUs NVML sees.
func cmdGPUs(args []string, stdout, stderr io.Writer) int {
	return gpusMain(memory.OpenNVML, args, stdout, stderr)
}

// gpusMain is qvd gpus with the GPU source given (NVML, or go-nvml's mock in tests).
func gpusMain(open func() memory.DeviceSource, args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("gpus")
	jsonOut := fs.Bool("json", false, "print JSON instead of a table")
	require := fs.Bool("require", false, "exit 1 when there is no GPU (default: say why and exit 0)")
	if code, ok := parseFlags(fs, args, stdout, stderr); !ok {
		return code
	}
	if fs.NArg() > 0 {
		return usageError(fs, stderr, "unexpected argument %q", fs.Arg(0))
	}
	src := open()
	if c, ok := src.(io.Closer); ok {
		defer c.Close()
	}
	rep, err := memory.ReadGPUs(src)
	code := exitOK
	if err == nil && len(rep.GPUs) == 0 && *require {
		code = exitFailure
	}
	switch {
	case err != nil:
	case *jsonOut:
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		err = enc.Encode(rep)
	case len(rep.GPUs) == 0:
		w := stdout
		if code != exitOK {
			w = stderr
		}
		fmt.Fprintf(w, "No GPU: %s\n", rep.Reason)
	default:
		err = rep.WriteTable(stdout)
	}
	if err != nil {
		fmt.Fprintf(stderr, "qvd gpus: %v\n", err)
		return exitFailure
	}
	return code
}
