package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/memory"
)

// cmdGPUs lists the GPUs NVML sees.
func cmdGPUs(args []string, stdout, stderr io.Writer) int {
	return gpusMain(memory.OpenNVML, args, stdout, stderr)
}

// gpusReport is the --json output.
type gpusReport struct {
	memory.Inventory
	Reason string `json:"reason,omitempty"` // why there is no GPU
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
	rep, err := inventory(src)
	if err != nil {
		fmt.Fprintf(stderr, "qvd gpus: %v\n", err)
		return exitFailure
	}
	code := exitOK
	if len(rep.GPUs) == 0 && *require {
		code = exitFailure
	}
	if *jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			fmt.Fprintf(stderr, "qvd gpus: %v\n", err)
			return exitFailure
		}
		return code
	}
	if len(rep.GPUs) == 0 {
		w := stdout
		if code != exitOK {
			w = stderr
		}
		fmt.Fprintf(w, "No GPU: %s\n", rep.Reason)
		return code
	}
	if err := formatGPUs(stdout, rep.Inventory); err != nil {
		fmt.Fprintf(stderr, "qvd gpus: %v\n", err)
		return exitFailure
	}
	return code
}

// inventory reads src: the full inventory from NVML, memory alone from another source, and
// the reason when there is no GPU (not an error: a machine without one is a valid answer).
func inventory(src memory.DeviceSource) (gpusReport, error) {
	rep := gpusReport{Inventory: memory.Inventory{GPUs: []memory.GPU{}}}
	if inv, ok := src.(memory.Inventorier); ok {
		got, err := inv.Inventory()
		if err != nil {
			return rep, err
		}
		rep.Inventory = got
		if len(rep.GPUs) == 0 {
			rep.GPUs, rep.Reason = []memory.GPU{}, "NVML found no GPU"
		}
		return rep, nil
	}
	devs, err := src.Devices()
	if errors.Is(err, memory.ErrNoDevice) || err == nil && len(devs) == 0 {
		rep.Reason = "no GPU"
		if nd, ok := src.(memory.NoDevices); ok {
			rep.Reason = nd.Reason
		}
		return rep, nil
	}
	if err != nil {
		return rep, err
	}
	for _, d := range devs {
		rep.GPUs = append(rep.GPUs, memory.GPU{Index: d.Index, Name: d.Name, MemoryUsed: d.Used, MemoryTotal: d.Total})
	}
	return rep, nil
}

// formatGPUs writes the table, under a line with the driver's versions when they are known.
func formatGPUs(w io.Writer, inv memory.Inventory) error {
	if inv.Driver != "" || inv.CUDADriver != "" {
		driver, cuda := inv.Driver, inv.CUDADriver
		if driver == "" {
			driver = "unknown"
		}
		if cuda == "" {
			cuda = "unknown"
		}
		fmt.Fprintf(w, "NVIDIA driver %s, CUDA %s\n", driver, cuda)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tNAME\tMEMORY USED / TOTAL\tGPU UTIL\tMEM UTIL\tTEMP\tPOWER")
	for _, g := range inv.GPUs {
		mem := memstat.FormatBytes(g.MemoryUsed) + " / " + memstat.FormatBytes(g.MemoryTotal)
		power := "-"
		switch {
		case g.PowerWatts != nil && g.PowerLimit != nil:
			power = fmt.Sprintf("%.0f W / %.0f W", *g.PowerWatts, *g.PowerLimit)
		case g.PowerWatts != nil:
			power = fmt.Sprintf("%.0f W", *g.PowerWatts)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%s\n", g.Index, g.Name, mem,
			optional(g.UtilGPU, "%"), optional(g.UtilMemory, "%"), optional(g.Temperature, " C"), power)
	}
	return tw.Flush()
}

func optional(v *uint32, unit string) string {
	if v == nil {
		return "-"
	}
	return strconv.FormatUint(uint64(*v), 10) + unit
}
