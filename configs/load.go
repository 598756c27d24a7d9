package configs

import (
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"reflect"
	"sort"
	"strconv"
	"strings"

	"github.com/qvd/qvd/model"
	"go.yaml.in/yaml/v3"
)

// The example configs ship inside the binary, so `qvd train` works from any directory and
// `-c fashion-cnn` names one without a path.
//
//go:embed *.yaml
var embedded embed.FS

// DefaultName is the embedded config `qvd train` uses without -c.
const DefaultName = "fashion-mlp"

// Embedded lists the names of the embedded configs (without .yaml).
func Embedded() []string {
	entries, _ := fs.ReadDir(embedded, ".")
	var names []string
	for _, e := range entries {
		names = append(names, strings.TrimSuffix(e.Name(), ".yaml"))
	}
	sort.Strings(names)
	return names
}

// EmbeddedYAML returns an embedded config's text.
func EmbeddedYAML(name string) ([]byte, error) {
	b, err := embedded.ReadFile(strings.TrimSuffix(name, ".yaml") + ".yaml")
	if err != nil {
		return nil, fmt.Errorf("no embedded config %q (have: %s)", name, strings.Join(Embedded(), ", "))
	}
	return b, nil
}

// ErrInvalid marks configuration errors (bad YAML, unknown keys, invalid values).
var ErrInvalid = errors.New("invalid configuration")

// Load reads a config: a YAML file at path, or, if no such file exists and path has no
// directory part, the embedded config of that name. The result is defaults overlaid with
// the file, not yet validated (flags may still change it).
func Load(path string) (Config, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		if errors.Is(err, fs.ErrNotExist) && !strings.ContainsRune(path, os.PathSeparator) {
			if eb, eerr := EmbeddedYAML(path); eerr == nil {
				return Parse(eb, "embedded:"+path)
			}
		}
		return Config{}, fmt.Errorf("config: %w", err)
	}
	return Parse(b, path)
}

// Parse overlays YAML text on the defaults. Unknown keys and values of the wrong type are
// errors naming the key path and line; source names the text in messages.
func Parse(text []byte, source string) (Config, error) {
	c := Default()
	var doc yaml.Node
	if err := yaml.Unmarshal(text, &doc); err != nil {
		return Config{}, fmt.Errorf("%w: %s: %v", ErrInvalid, source, err)
	}
	if len(doc.Content) == 0 {
		return c, nil // empty file: all defaults
	}
	var errs []error
	decodeStrict(doc.Content[0], reflect.ValueOf(&c).Elem(), "", &errs)
	if len(errs) > 0 {
		return Config{}, fmt.Errorf("%w: %s:\n  %w", ErrInvalid, source, joinLines(errs))
	}
	modelDefaults(doc.Content[0], &c)
	return c, nil
}

// modelDefaults settles what the model's defaults depend on: `layers` without a `type` means
// type layers, and the MLP's default hidden sizes apply to types mlp and cnn only.
func modelDefaults(root *yaml.Node, c *Config) {
	m := mappingValue(root, "model")
	if m == nil {
		return
	}
	if mappingValue(m, "layers") != nil && mappingValue(m, "type") == nil {
		c.Model.Type = model.TypeLayers
	}
	if (c.Model.Type == model.TypeViT || c.Model.Type == model.TypeLayers) && mappingValue(m, "hidden") == nil {
		c.Model.Hidden = nil
	}
}

// mappingValue is the value of key in a mapping node, nil if absent.
func mappingValue(n *yaml.Node, key string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return n.Content[i+1]
		}
	}
	return nil
}

func joinLines(errs []error) error {
	msgs := make([]string, len(errs))
	for i, e := range errs {
		msgs[i] = e.Error()
	}
	return errors.New(strings.Join(msgs, "\n  "))
}

// decodeStrict decodes node into v, descending into structs itself so that an unknown key or
// a badly typed value is reported with its full path ("optimizer.betas", line 12).
func decodeStrict(node *yaml.Node, v reflect.Value, path string, errs *[]error) {
	if node.Kind == yaml.AliasNode && node.Alias != nil {
		node = node.Alias
	}
	if v.Kind() == reflect.Slice && v.Type().Elem().Kind() == reflect.Struct && node.Kind == yaml.SequenceNode {
		// A list of sections (model.layers): each element strictly, named by its index.
		s := reflect.MakeSlice(v.Type(), len(node.Content), len(node.Content))
		for i, el := range node.Content {
			decodeStrict(el, s.Index(i), fmt.Sprintf("%s[%d]", path, i), errs)
		}
		v.Set(s)
		return
	}
	if v.Kind() != reflect.Struct {
		if err := node.Decode(v.Addr().Interface()); err != nil {
			*errs = append(*errs, fmt.Errorf("%s (line %d): %s", path, node.Line, cleanYAMLError(err)))
		}
		return
	}
	if node.Kind == yaml.ScalarNode && node.Tag == "!!null" {
		return // "section:" with nothing under it keeps the defaults
	}
	if node.Kind != yaml.MappingNode {
		*errs = append(*errs, fmt.Errorf("%s (line %d): expected a mapping of keys, got %s", orRoot(path), node.Line, kindName(node)))
		return
	}
	fields := map[string]int{}
	var known []string
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		name := strings.Split(t.Field(i).Tag.Get("yaml"), ",")[0]
		if name == "" || name == "-" {
			continue
		}
		fields[name] = i
		known = append(known, name)
	}
	seen := map[string]int{}
	for i := 0; i+1 < len(node.Content); i += 2 {
		k, val := node.Content[i], node.Content[i+1]
		key := join(path, k.Value)
		if line, dup := seen[k.Value]; dup {
			*errs = append(*errs, fmt.Errorf("%s (line %d): key already defined at line %d", key, k.Line, line))
			continue
		}
		seen[k.Value] = k.Line
		fi, ok := fields[k.Value]
		if !ok {
			*errs = append(*errs, fmt.Errorf("%s (line %d): unknown key (known keys here: %s)", key, k.Line, strings.Join(known, ", ")))
			continue
		}
		// A numeric field tagged `auto:"N"` also takes the word auto, stored as N (e.g.
		// train.micro_batch: auto, resolved before training).
		a, isAuto := t.Field(fi).Tag.Lookup("auto")
		if isAuto && val.Kind == yaml.ScalarNode && val.Value == "auto" {
			if n, err := strconv.ParseInt(a, 10, 64); err == nil && v.Field(fi).CanInt() {
				v.Field(fi).SetInt(n)
				continue
			}
		}
		decodeStrict(val, v.Field(fi), key, errs)
		// The stored N is negative: a negative number written in the file would otherwise
		// pass for auto (micro_batch: -1). Only the word auto means auto.
		if isAuto && v.Field(fi).CanInt() && v.Field(fi).Int() < 0 {
			*errs = append(*errs, fmt.Errorf("%s (line %d): must be a positive number or auto, got %d", key, val.Line, v.Field(fi).Int()))
		}
	}
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

func orRoot(path string) string {
	if path == "" {
		return "top level"
	}
	return path
}

func kindName(n *yaml.Node) string {
	switch n.Kind {
	case yaml.SequenceNode:
		return "a list"
	case yaml.ScalarNode:
		return fmt.Sprintf("the value %q", n.Value)
	}
	return "something else"
}

// cleanYAMLError drops yaml.v3's "yaml: unmarshal errors:\n  line N:" wrapping, since the
// caller already names the key and line.
func cleanYAMLError(err error) string {
	var te *yaml.TypeError
	if errors.As(err, &te) && len(te.Errors) > 0 {
		msg := te.Errors[0]
		if i := strings.Index(msg, ": "); i >= 0 && strings.HasPrefix(msg, "line ") {
			msg = msg[i+2:]
		}
		return msg
	}
	return err.Error()
}
