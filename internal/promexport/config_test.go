package promexport

import "testing"

func TestRankAddr(t *testing.T) {
	for _, c := range []struct {
		base string
		rank int
		want string // "" = an error
	}{
		{"127.0.0.1:9400", 0, "127.0.0.1:9400"},
		{"127.0.0.1:9400", 3, "127.0.0.1:9403"},
		{":9400", 1, ":9401"},
		{"[::1]:9400", 2, "[::1]:9402"},
		{"127.0.0.1:0", 5, "127.0.0.1:0"}, // every rank picks a free port
		{"127.0.0.1:65535", 0, "127.0.0.1:65535"},
		{"127.0.0.1:65535", 1, ""},
		{"127.0.0.1", 0, ""},
		{"127.0.0.1:http", 0, ""},
		{"127.0.0.1:-1", 0, ""},
		{"127.0.0.1:9400", -1, ""},
	} {
		got, err := RankAddr(c.base, c.rank)
		if c.want == "" && err == nil || c.want != "" && (err != nil || got != c.want) {
			t.Errorf("RankAddr(%q, %d) = %q, %v; want %q", c.base, c.rank, got, err, c.want)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	for addr, ok := range map[string]bool{"": true, ":9400": true, "0.0.0.0:0": true, "localhost:9400": true,
		"9400": false, "host:99999": false, "host:": false} {
		if err := (Config{MetricsAddr: addr}).Validate(); (err == nil) != ok {
			t.Errorf("metrics_addr %q: %v", addr, err)
		}
	}
}
