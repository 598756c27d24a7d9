package model

import (
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/qvd/qvd/checkpoint"
)

// Rename is one init_map rule: tensor names in the file that match the regular expression
// From are rewritten with To (regexp.ReplaceAllString: $1 names a group), e.g.
// {from: '^backbone\.', to: ”} strips a prefix.
type Rename struct {
	From string `yaml:"from" json:"from"`
	To   string `yaml:"to" json:"to"`
}

// InitConfig initialises a model's weights from a safetensors file (pretrained weights, a
// qvd checkpoint's model.safetensors, or PyTorch's state_dict saved as safetensors) instead
// of leaving them at the random initialisation. YAML: the top-level keys init_from, init_map
// and init_strict.
type InitConfig struct {
	// From is the safetensors file; "" leaves the random initialisation.
	From string `yaml:"init_from" json:"init_from"`
	// Map renames the file's tensors, each rule applied in order to the result of the
	// previous ones, before they are matched to the model's tensor names (fc1.weight, ...).
	Map []Rename `yaml:"init_map" json:"init_map"`
	// Strict makes a model tensor the file lacks, or a file tensor the model has no place
	// for, an error. false loads what matches (a backbone without its head) and keeps the
	// random initialisation of the rest.
	Strict bool `yaml:"init_strict" json:"init_strict"`
}

// DefaultInitConfig loads nothing, strictly.
func DefaultInitConfig() InitConfig { return InitConfig{Strict: true} }

// Errors callers may test for.
var (
	// ErrInitShape: a file tensor has another shape than the model tensor it is matched to.
	ErrInitShape = errors.New("shape mismatch")
	// ErrInitMismatch: with init_strict, the file and the model do not hold the same tensors.
	ErrInitMismatch = errors.New("the file's tensors do not match the model's")
)

// Validate checks the fields; errors name the key (init_map[1].from).
func (c InitConfig) Validate() error {
	if c.From == "" && len(c.Map) > 0 {
		return errors.New("init_map: set without init_from (the file whose tensors it renames)")
	}
	for i, r := range c.Map {
		if r.From == "" {
			return fmt.Errorf("init_map[%d].from: must be a regular expression, got an empty string", i)
		}
		if _, err := regexp.Compile(r.From); err != nil {
			return fmt.Errorf("init_map[%d].from: %w", i, err)
		}
	}
	return nil
}

// InitLoaded is one tensor copied into the model.
type InitLoaded struct {
	File, Model string // its name in the file and in the model (differ when init_map renamed it)
	Shape       []int
}

// InitReport is what a load did.
type InitReport struct {
	Loaded []InitLoaded
	// Missing are the model tensors the file did not provide: they keep their initialisation.
	Missing []string
	// Unexpected are the file tensors, by their name in the file, that match no model tensor
	// (after init_map); with their renamed name where it differs, "name (as renamed)".
	Unexpected []string
}

// LoadInit reads the safetensors file c.From and copies its tensors, renamed by c.Map, into
// flat (laid out by l), converting each to the flat buffer's order (Linear weights are
// stored transposed). Every matched tensor is checked before any is written, so on error
// flat is unchanged.
func LoadInit(c InitConfig, l *Layout, flat []float32) (InitReport, error) {
	if err := c.Validate(); err != nil {
		return InitReport{}, err
	}
	f, err := checkpoint.ReadSafetensorsFile(c.From)
	if err != nil {
		return InitReport{}, err
	}
	rep, err := InitFromFile(f, c.Map, c.Strict, l, flat)
	if err != nil {
		return rep, fmt.Errorf("%s: %w", c.From, err)
	}
	return rep, nil
}

// InitFromFile is LoadInit on a parsed file.
func InitFromFile(f *checkpoint.File, renames []Rename, strict bool, l *Layout, flat []float32) (InitReport, error) {
	if len(flat) != l.Size {
		return InitReport{}, fmt.Errorf("flat buffer has %d elements, the layout needs %d", len(flat), l.Size)
	}
	res := make([]*regexp.Regexp, len(renames))
	for i, r := range renames {
		re, err := regexp.Compile(r.From)
		if err != nil {
			return InitReport{}, fmt.Errorf("init_map[%d].from: %w", i, err)
		}
		res[i] = re
	}
	var rep InitReport
	var errs []error
	byModel := map[string]string{} // model name -> file name
	for _, name := range f.Names() {
		mapped := name
		for i, re := range res {
			mapped = re.ReplaceAllString(mapped, renames[i].To)
		}
		t, ok := l.Lookup(mapped)
		if !ok {
			u := name
			if mapped != name {
				u += " (as " + mapped + ")"
			}
			rep.Unexpected = append(rep.Unexpected, u)
			continue
		}
		if prev, dup := byModel[mapped]; dup {
			errs = append(errs, fmt.Errorf("tensors %q and %q both map to %q: fix init_map", prev, name, mapped))
			continue
		}
		byModel[mapped] = name
		info, err := f.Info(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if !checkpoint.Widening(info.Dtype) {
			errs = append(errs, fmt.Errorf("tensor %s: the file's %q has dtype %s; only F32, F16 and BF16 load (save it with .float())", mapped, name, info.Dtype))
			continue
		}
		if !slices.Equal(info.Shape, t.Shape) {
			errs = append(errs, fmt.Errorf("tensor %s: %w: the file's %q is %v, the model's is %v", mapped, ErrInitShape, name, info.Shape, t.Shape))
			continue
		}
		rep.Loaded = append(rep.Loaded, InitLoaded{File: name, Model: mapped, Shape: slices.Clone(t.Shape)})
	}
	for _, t := range l.Tensors {
		if _, ok := byModel[t.Name]; !ok {
			rep.Missing = append(rep.Missing, t.Name)
		}
	}
	if strict && (len(rep.Missing) > 0 || len(rep.Unexpected) > 0) {
		var parts []string
		if len(rep.Missing) > 0 {
			parts = append(parts, fmt.Sprintf("missing from the file: %s", strings.Join(rep.Missing, ", ")))
		}
		if len(rep.Unexpected) > 0 {
			parts = append(parts, fmt.Sprintf("not in the model: %s", strings.Join(rep.Unexpected, ", ")))
		}
		errs = append(errs, fmt.Errorf("%w: %s", ErrInitMismatch, strings.Join(parts, "; ")))
	}
	if len(errs) > 0 {
		return rep, errors.Join(errs...)
	}
	var buf []float32
	for _, ld := range rep.Loaded {
		t, _ := l.Lookup(ld.Model)
		if cap(buf) < t.Size {
			buf = make([]float32, t.Size)
		}
		buf = buf[:t.Size]
		if err := f.ReadInto(ld.File, buf, t.Shape); err != nil {
			return rep, err // cannot happen: name, dtype and shape were checked above
		}
		l.SetCanonical(flat, buf, t)
	}
	return rep, nil
}
