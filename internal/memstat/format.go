package memstat

import "strconv"

var byteUnits = [...]string{"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"}

// FormatBytes formats n with binary units: "17 B", "312.0 MiB", "1.5 GiB". Amounts of a KiB
// or more keep one decimal so that figures logged step after step line up.
func FormatBytes(n uint64) string {
	if n < 1024 {
		return strconv.FormatUint(n, 10) + " B"
	}
	v := float64(n) / 1024
	unit := 1
	// Move up a unit before printing would round to "1024.0": 1023.95 KiB reads as 1.0 MiB.
	for v >= 1023.95 && unit < len(byteUnits)-1 {
		v /= 1024
		unit++
	}
	return strconv.FormatFloat(v, 'f', 1, 64) + " " + byteUnits[unit]
}
