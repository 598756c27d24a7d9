package archtest

import (
	"bufio"
	"fmt"
	"io"
	"strconv"
	"strings"
)

// Layer is one row of the table: a number (higher may import lower), a name, and package
// patterns relative to the module path ("x" is exactly x, "x/..." is every package below x).
type Layer struct {
	Level    int
	Name     string
	Patterns []string
}

// Parse reads the fenced block tagged "layers" from a markdown document.
func Parse(r io.Reader) ([]Layer, error) {
	var layers []Layer
	in, seen := false, false
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "```layers":
			in, seen = true, true
			continue
		case in && line == "```":
			in = false
			continue
		case !in || line == "":
			continue
		}
		head, pats, ok := strings.Cut(line, ":")
		f := strings.Fields(head)
		if !ok || len(f) != 2 {
			return nil, fmt.Errorf("line %d: %q: want \"LEVEL NAME: PATTERN ...\"", n, line)
		}
		lvl, err := strconv.Atoi(f[0])
		if err != nil {
			return nil, fmt.Errorf("line %d: layer level %q: %v", n, f[0], err)
		}
		layers = append(layers, Layer{Level: lvl, Name: f[1], Patterns: strings.Fields(pats)})
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if !seen {
		return nil, fmt.Errorf("no ```layers block")
	}
	return layers, nil
}

// LevelOf returns the layer of pkg (relative to the module): an exact pattern wins over a
// "/..." one, and a longer "/..." prefix over a shorter one.
func LevelOf(layers []Layer, pkg string) (Layer, bool) {
	best, bestLen, found := Layer{}, -1, false
	for _, l := range layers {
		for _, p := range l.Patterns {
			n := -1
			if p == pkg {
				n = 1 << 30
			} else if pre, ok := strings.CutSuffix(p, "/..."); ok && strings.HasPrefix(pkg, pre+"/") {
				n = len(pre)
			}
			if n > bestLen {
				best, bestLen, found = l, n, true
			}
		}
	}
	return best, found
}

// Violations lists, for a graph of package → imports (module-relative, only the module's own
// packages), every package not in the table and every import of a higher layer.
func Violations(layers []Layer, graph map[string][]string) []string {
	var out []string
	for pkg, imps := range graph {
		l, ok := LevelOf(layers, pkg)
		if !ok {
			out = append(out, fmt.Sprintf("%s is in no layer of docs/architecture.md", pkg))
			continue
		}
		for _, imp := range imps {
			il, ok := LevelOf(layers, imp)
			if ok && il.Level > l.Level {
				out = append(out, fmt.Sprintf("%s (layer %d %s) imports %s (layer %d %s)", pkg, l.Level, l.Name, imp, il.Level, il.Name))
			}
		}
	}
	return out
}
