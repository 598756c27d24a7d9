package archtest

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestLevelOf(t *testing.T) {
	layers := []Layer{
		{0, "foundation", []string{"internal/..."}},
		{2, "parts", []string{"collective", "collective/grpcnet"}},
		{3, "engines", []string{"collective/nccl", "engine/..."}},
		{4, "training", []string{"internal/dashboard", "checkpoint/..."}},
		{1, "leaves", []string{"checkpoint"}},
	}
	for _, tc := range []struct {
		pkg   string
		level int
		ok    bool
	}{
		{"internal/half", 0, true},
		{"internal/dashboard", 4, true}, // exact beats internal/...
		{"collective", 2, true},
		{"collective/nccl", 3, true},
		{"collective/shmnet", 0, false},
		{"engine", 0, false}, // engine/... covers subpackages only
		{"engine/cpu", 3, true},
		{"checkpoint", 1, true},
		{"checkpoint/sharded", 4, true},
		{"internalx", 0, false},
	} {
		l, ok := LevelOf(layers, tc.pkg)
		if ok != tc.ok || (ok && l.Level != tc.level) {
			t.Errorf("LevelOf(%q) = %d, %v; want %d, %v", tc.pkg, l.Level, ok, tc.level, tc.ok)
		}
	}
	got := Violations(layers, map[string][]string{
		"collective":        {"internal/half"},
		"collective/nccl":   {"collective", "internal/dashboard"},
		"collective/shmnet": {"collective"},
	})
	slices.Sort(got)
	want := []string{
		"collective/nccl (layer 3 engines) imports internal/dashboard (layer 4 training)",
		"collective/shmnet is in no layer of docs/architecture.md",
	}
	if !slices.Equal(got, want) {
		t.Errorf("Violations:\n got %q\nwant %q", got, want)
	}
}

func TestParseRejects(t *testing.T) {
	for _, doc := range []string{"no block", "```layers\nx foundation: a\n```", "```layers\n0 a b: c\n```"} {
		if _, err := Parse(strings.NewReader(doc)); err == nil {
			t.Errorf("Parse(%q): no error", doc)
		}
	}
}

// TestImportDirections checks the module's real import graph, with and without -tags cuda,
// against docs/architecture.md.
func TestImportDirections(t *testing.T) {
	root := moduleRoot(t)
	f, err := os.Open(filepath.Join(root, "docs", "architecture.md"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	layers, err := Parse(f)
	if err != nil {
		t.Fatalf("docs/architecture.md: %v", err)
	}
	for _, tags := range []string{"", "cuda"} {
		graph := importGraph(t, root, tags)
		if len(graph) < 20 {
			t.Fatalf("go list -tags %q found only %d packages", tags, len(graph))
		}
		for _, v := range Violations(layers, graph) {
			t.Errorf("-tags %q: %s", tags, v)
		}
	}
}

func moduleRoot(t *testing.T) string {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(strings.TrimSpace(string(out)))
}

// importGraph is every package of the module with its non-test imports inside the module,
// paths relative to the module.
func importGraph(t *testing.T, root, tags string) map[string][]string {
	mod, err := exec.Command("go", "list", "-m").Output()
	if err != nil {
		t.Fatalf("go list -m: %v", err)
	}
	prefix := strings.TrimSpace(string(mod)) + "/"
	cmd := exec.Command("go", "list", "-e", "-tags", tags, "-f", "{{.ImportPath}}{{range .Imports}} {{.}}{{end}}", "./...")
	cmd.Dir = root
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	graph := map[string][]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg, ok := strings.CutPrefix(f[0], prefix)
		if !ok {
			continue
		}
		var imps []string
		for _, imp := range f[1:] {
			if rel, ok := strings.CutPrefix(imp, prefix); ok {
				imps = append(imps, rel)
			}
		}
		graph[pkg] = imps
	}
	return graph
}
