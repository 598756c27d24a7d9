package data

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestLoadMapped: images are mapped — a raw file where it is, a gzip one through a copy in
// data.cache that the next Load reuses — with the same pixels as reading them into memory; a
// damaged copy is made again; data.cache: none, and a cache that cannot be written, read the
// images into memory instead.
func TestLoadMapped(t *testing.T) {
	for _, gz := range []bool{true, false} {
		dir := t.TempDir()
		synthSplit(t, dir, TrainImagesFile, TrainLabelsFile, 50, 6, 5, gz)
		synthSplit(t, dir, TestImagesFile, TestLabelsFile, 10, 6, 5, gz)
		cfg := synthConfig(dir)
		inMem := cfg
		inMem.Cache = CacheNone
		want, _, err := Load(inMem)
		if err != nil {
			t.Fatal(err)
		}
		if want.Mapped != "" {
			t.Fatalf("gzip %v: cache none mapped %s", gz, want.Mapped)
		}
		train, _, err := Load(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if train.Mapped == "" || string(train.Images) != string(want.Images) || train.N != 50 || train.H != 6 || train.W != 5 {
			t.Fatalf("gzip %v: mapped %q, N %d %dx%d, pixels equal %v", gz, train.Mapped, train.N, train.H, train.W, string(train.Images) == string(want.Images))
		}
		inCache := strings.HasPrefix(train.Mapped, cfg.Cache)
		if inCache != gz {
			t.Fatalf("gzip %v: mapped %s (cache %s)", gz, train.Mapped, cfg.Cache)
		}
		if !gz {
			continue
		}
		st1, _ := os.Stat(train.Mapped)
		again, _, err := Load(cfg)
		if err != nil || again.Mapped != train.Mapped {
			t.Fatalf("second load: %v, mapped %s then %s", err, train.Mapped, again.Mapped)
		}
		if st2, _ := os.Stat(again.Mapped); !os.SameFile(st1, st2) {
			t.Fatal("the second load decompressed again instead of reusing the copy")
		}
		// A truncated copy (a disk that lost its tail) is detected and made again.
		if err := os.Truncate(train.Mapped, 40); err != nil {
			t.Fatal(err)
		}
		fixed, _, err := Load(cfg)
		if err != nil || string(fixed.Images) != string(want.Images) {
			t.Fatalf("after truncating the copy: %v", err)
		}
		// A cache directory that cannot be made: read into memory.
		blocker := filepath.Join(dir, "file")
		if err := os.WriteFile(blocker, nil, 0o644); err != nil {
			t.Fatal(err)
		}
		cfg.Cache = filepath.Join(blocker, "cache")
		mem, _, err := Load(cfg)
		if err != nil || mem.Mapped != "" || string(mem.Images) != string(want.Images) {
			t.Fatalf("unusable cache: %v, mapped %q", err, mem.Mapped)
		}
	}
}
