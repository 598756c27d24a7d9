package configs

import (
	"strings"
	"testing"
)

// TestInitFromKeys: init_from, init_map and init_strict parse at the top level, init_strict
// defaults to true, and bad values are errors naming the key.
func TestInitFromKeys(t *testing.T) {
	c, err := Parse([]byte("init_from: w.safetensors\ninit_map:\n  - {from: '^backbone\\.', to: ''}\n  - {from: 'head', to: 'fc3'}\n"), "test")
	if err != nil {
		t.Fatal(err)
	}
	c.Resolve()
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	ic := c.Init()
	if ic.From != "w.safetensors" || !ic.Strict || len(ic.Map) != 2 || ic.Map[0].From != `^backbone\.` || ic.Map[1].To != "fc3" {
		t.Fatalf("init config %+v", ic)
	}
	if d := Default(); d.Init().Strict != true || d.Init().From != "" {
		t.Fatalf("defaults %+v", d.Init())
	}
	cases := []struct{ yaml, want string }{
		{"init_from: w.safetensors\ninit_map:\n  - {from: '(', to: ''}\n", "init_map[0].from"},
		{"init_map:\n  - {from: 'a', to: 'b'}\n", "init_map: set without init_from"},
		{"init_strict: maybe\n", "init_strict (line 1)"},
		{"init_from: [a]\n", "init_from (line 1)"},
	}
	for _, tc := range cases {
		c, err := Parse([]byte(tc.yaml), "test")
		if err == nil {
			c.Resolve()
			err = c.Validate()
		}
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: error %v, want one containing %q", tc.yaml, err, tc.want)
		}
	}
	c, err = Parse([]byte("init_from: w.safetensors\ninit_strict: false\n"), "test")
	if err != nil || c.Init().Strict {
		t.Fatalf("init_strict false: %+v, %v", c.Init(), err)
	}
}
