package memory

import "testing"

// TestParseBytesForms covers every form a config or a command-line flag gives a size in:
// those memory's config took, those `qvd bench --sizes` took before it shared this parser
// (KiB/MiB/GiB/KB/MB/GB, fractions), and nccl-tests' and docker's one-letter units.
func TestParseBytesForms(t *testing.T) {
	for _, c := range []struct {
		in   string
		want Bytes
	}{
		{"8", 8}, {"1024", 1024}, {"0", 0}, {"1e6", 1e6},
		{"64MiB", 64 << 20}, {"1GiB", 1 << 30}, {"4KiB", 4 << 10}, {"2TiB", 2 << 40}, {"0.5MiB", 1 << 19},
		{"1KB", 1e3}, {"1kB", 1e3}, {"64MB", 64e6}, {"1GB", 1e9}, {"1TB", 1e12}, {"100B", 100},
		{"512M", 512 << 20}, {"512m", 512 << 20}, {"4k", 4 << 10}, {"4K", 4 << 10},
		{"1G", 1 << 30}, {"2g", 2 << 30}, {"1T", 1 << 40}, {"1.5G", 3 << 29},
		{" 64 MiB ", 64 << 20},
	} {
		if got, err := ParseBytes(c.in); err != nil || got != c.want {
			t.Errorf("ParseBytes(%q) = %d, %v; want %d", c.in, got, err, c.want)
		}
	}
	for _, bad := range []string{"", "M", "MiB", "-4k", "4x", "4kk", "4 Mi", "4iB", "Inf", "1e30GiB", "64MiB,1GiB"} {
		if got, err := ParseBytes(bad); err == nil {
			t.Errorf("ParseBytes(%q) = %d, want an error", bad, got)
		}
	}
}
