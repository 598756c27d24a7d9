// Package dynlib finds and opens the NVIDIA libraries qvd calls at run time (cuBLAS, NCCL)
// with purego, so a binary built here with CUDA 11.8 headers runs against whatever CUDA the
// GPU machine has (libcublas.so.13 beside a 580 driver) and a machine without them gets a
// clear error instead of a loader failure at start.
// It must not import any qvd package outside internal/ (the foundation layer of
// docs/architecture.md).
package dynlib

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/ebitengine/purego"
)

// Spec names a library: the environment variable that may hold its path, the sonames to try
// in order (newest first), and glob patterns of where pip wheels put it (PyTorch's
// nvidia-cublas, nvidia-nccl-cu13).
type Spec struct {
	What  string   // "cuBLAS"
	Env   string   // "QVD_CUBLAS_LIBRARY"
	Names []string // "libcublas.so.13", "libcublas.so.12", ...
	Globs []string // "/opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib/libcublas.so.*"
}

// Lib is an open library.
type Lib struct {
	Path   string
	handle uintptr
}

// ErrNotFound is wrapped by Open's error when no candidate could be loaded.
var ErrNotFound = errors.New("library not found")

// Candidates lists the paths Open tries, in order: $Env, the sonames (resolved by the
// dynamic loader: LD_LIBRARY_PATH, ld.so.cache), then the glob matches, newest name first.
func (s Spec) Candidates() []string {
	var out []string
	if p := os.Getenv(s.Env); s.Env != "" && p != "" {
		return []string{p} // an explicit choice is not second-guessed
	}
	out = append(out, s.Names...)
	for _, g := range s.Globs {
		m, _ := filepath.Glob(g)
		sort.Sort(sort.Reverse(sort.StringSlice(m)))
		out = append(out, m...)
	}
	return out
}

// Open loads the first candidate that loads. The error lists every attempt and names the
// environment variable that overrides the search.
func Open(s Spec) (*Lib, error) {
	var tried []string
	for _, p := range s.Candidates() {
		h, err := purego.Dlopen(p, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err == nil {
			return &Lib{Path: p, handle: h}, nil
		}
		tried = append(tried, fmt.Sprintf("%s (%v)", p, err))
	}
	hint := ""
	if s.Env != "" {
		hint = fmt.Sprintf("; set %s to the library's path", s.Env)
	}
	return nil, fmt.Errorf("%w: %s: tried %s%s", ErrNotFound, s.What, strings.Join(tried, ", "), hint)
}

// Bind points fptr (a pointer to a func variable) at the library's symbol name.
func (l *Lib) Bind(fptr any, name string) error {
	sym, err := purego.Dlsym(l.handle, name)
	if err != nil {
		return fmt.Errorf("%s has no symbol %s: %w", l.Path, name, err)
	}
	purego.RegisterFunc(fptr, sym)
	return nil
}

// Close unloads the library.
func (l *Lib) Close() error {
	if l == nil || l.handle == 0 {
		return nil
	}
	err := purego.Dlclose(l.handle)
	l.handle = 0
	return err
}

// PipGlobs are where the NVIDIA pip wheels (as PyTorch installs them) keep lib, for a
// library file name pattern such as "libnccl.so.*".
func PipGlobs(file string) []string {
	var out []string
	for _, root := range []string{"/opt/*/.venv/lib/python3*/site-packages", "/usr/local/lib/python3*/dist-packages", "/usr/lib/python3/dist-packages", "/root/.local/lib/python3*/site-packages"} {
		out = append(out, root+"/nvidia/*/lib/"+file, root+"/nvidia/*/*/lib/"+file)
	}
	return out
}
