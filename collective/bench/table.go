package bench

import (
	"errors"
	"fmt"
	"strings"
)

// columns are the header words of Run's table, nccl-tests' own.
var columns = []string{"size", "count", "type", "redop", "root", "out-of-place", "in-place", "time", "algbw", "busbw", "#wrong"}

// ParseTable reads a table Run printed: it checks the header names every column and the
// table closes with the average bus bandwidth, and returns the data rows split into their 13
// fields. Scripts and tests that consume `qvd bench` output use it rather than guessing.
func ParseTable(table string) ([][]string, error) {
	var errs []error
	for _, col := range columns {
		if !strings.Contains(table, col) {
			errs = append(errs, fmt.Errorf("no %q column", col))
		}
	}
	if !strings.Contains(table, "# Avg bus bandwidth    : ") {
		errs = append(errs, errors.New("no average bus bandwidth line"))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("%w\nin\n%s", err, table)
	}
	var rows [][]string
	for _, line := range strings.Split(table, "\n") {
		if f := strings.Fields(line); len(f) > 0 && !strings.HasPrefix(f[0], "#") && !strings.HasPrefix(f[0], "[") {
			if len(f) != 13 {
				return nil, fmt.Errorf("row %q has %d fields, want 13", line, len(f))
			}
			rows = append(rows, f)
		}
	}
	return rows, nil
}
