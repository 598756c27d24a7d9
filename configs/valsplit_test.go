package configs

import (
	"strings"
	"testing"
)

// TestValSplit: data.val_split parses, and a value outside [0, 1) is an error naming it.
func TestValSplit(t *testing.T) {
	for _, c := range []struct {
		yaml string
		err  string
	}{
		{"data: {val_split: 0.1}", ""},
		{"data: {val_split: 0}", ""},
		{"data: {val_split: 1}", "data.val_split: must be in [0, 1)"},
		{"data: {val_split: -0.2}", "data.val_split: must be in [0, 1)"},
	} {
		cfg, err := Parse([]byte(c.yaml), "test")
		if err != nil {
			t.Fatalf("%s: %v", c.yaml, err)
		}
		cfg.Resolve()
		err = cfg.Validate()
		if c.err == "" && err != nil || c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)) {
			t.Errorf("%s: Validate() = %v, want %q", c.yaml, err, c.err)
		}
	}
}
