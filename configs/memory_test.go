package configs

import (
	"strings"
	"testing"

	"github.com/qvd/qvd/memory"
	"go.yaml.in/yaml/v3"
)

func TestMemorySection(t *testing.T) {
	d := Default()
	if d.Memory != memory.DefaultConfig() {
		t.Fatalf("default memory section %+v", d.Memory)
	}
	c, err := Parse([]byte("memory:\n  log_every: 20\n  min_available: 2GiB\n  limit: 24GiB\n  adapt: true\n"), "m.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if c.Memory.LogEvery != 20 || c.Memory.MinAvailable != "2GiB" || c.Memory.Limit != 24<<30 || !c.Memory.Adapt {
		t.Fatalf("parsed %+v", c.Memory)
	}
	// What `qvd config` prints, and what the coordinator sends to workers, parses back.
	text, err := yaml.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	back, err := Parse(text, "round trip")
	if err != nil || back.Memory != c.Memory {
		t.Fatalf("round trip %+v, %v\n%s", back.Memory, err, text)
	}
	if c, err := Parse([]byte("memory:\n  limit: 1073741824\n  min_available: 5%\n"), "m.yaml"); err != nil || c.Memory.Limit != 1<<30 || c.Memory.MinAvailable != "5%" {
		t.Fatalf("plain bytes: %+v, %v", c.Memory, err)
	}
	for _, bad := range []struct{ yaml, want string }{
		{"memory:\n  limit: lots\n", "memory.limit (line 2)"},
		{"memory:\n  log_evry: 3\n", "memory.log_evry (line 2): unknown key"},
	} {
		if _, err := Parse([]byte(bad.yaml), "m.yaml"); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("%q: error %v, want %q", bad.yaml, err, bad.want)
		}
	}
}

func TestMemoryValidateNamesTheField(t *testing.T) {
	for _, tc := range []struct {
		edit func(*Config)
		want string
	}{
		{func(c *Config) { c.Memory.LogEvery = -1 }, "memory.log_every"},
		{func(c *Config) { c.Memory.MinAvailable = "120%" }, "memory.min_available"},
		{func(c *Config) { c.Memory.MinAvailable = "much" }, "memory.min_available"},
		{func(c *Config) { c.Memory.Limit = -1 }, "memory.limit"},
	} {
		c := Default()
		tc.edit(&c)
		c.Resolve()
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want an error naming %s, got %v", tc.want, err)
		}
	}
}
