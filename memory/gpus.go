package memory

import (
	"errors"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/qvd/qvd/internal/memstat"
)

// GPUReport is what `qvd gpus` shows: the inventory, and why there is no GPU.
type GPUReport struct {
	Inventory
	Reason string `json:"reason,omitempty"` // why there is no GPU
}

// ReadGPUs reads src: the full inventory from NVML (an Inventorier), memory alone from
// another source, and the reason when there is no GPU (not an error: a machine without one
// is a valid answer).
func ReadGPUs(src DeviceSource) (GPUReport, error) {
	rep := GPUReport{Inventory: Inventory{GPUs: []GPU{}}}
	if inv, ok := src.(Inventorier); ok {
		got, err := inv.Inventory()
		if err != nil {
			return rep, err
		}
		rep.Inventory = got
		if len(rep.GPUs) == 0 {
			rep.GPUs, rep.Reason = []GPU{}, "NVML found no GPU"
		}
		return rep, nil
	}
	devs, err := src.Devices()
	if errors.Is(err, ErrNoDevice) || err == nil && len(devs) == 0 {
		rep.Reason = "no GPU"
		if nd, ok := src.(NoDevices); ok {
			rep.Reason = nd.Reason
		}
		return rep, nil
	}
	if err != nil {
		return rep, err
	}
	for _, d := range devs {
		rep.GPUs = append(rep.GPUs, GPU{Index: d.Index, Name: d.Name, MemoryUsed: d.Used, MemoryTotal: d.Total})
	}
	return rep, nil
}

// WriteTable writes the GPUs as a table, under a line with the driver's versions when they
// are known; what a source does not report is "-".
func (inv Inventory) WriteTable(w io.Writer) error {
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
