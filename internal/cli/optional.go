package cli

import "flag"

// Optional registers a flag whose *p stays nil unless the command line gives it, and then
// points at its value: an override that must not replace a config's value with a flag's
// default. It parses and reports errors as the flag package's own flag of type T does, and
// help shows it as that flag ("-epochs N").
func Optional[T int | int64 | uint64 | float64 | string](fs *flag.FlagSet, p **T, name, usage string) {
	o := &optional[T]{p: p}
	scratch := flag.NewFlagSet(name, flag.ContinueOnError)
	switch v := any(&o.v).(type) {
	case *int:
		scratch.IntVar(v, name, 0, "")
	case *int64:
		scratch.Int64Var(v, name, 0, "")
	case *uint64:
		scratch.Uint64Var(v, name, 0, "")
	case *float64:
		scratch.Float64Var(v, name, 0, "")
	case *string:
		scratch.StringVar(v, name, "", "")
	}
	o.std = scratch.Lookup(name)
	fs.Var(o, name, usage)
}

// optional is Optional's flag.Value: std, the standard flag of its type, parses into v.
type optional[T any] struct {
	p   **T
	v   T
	std *flag.Flag
}

func (o *optional[T]) Set(s string) error {
	if err := o.std.Value.Set(s); err != nil {
		return err
	}
	*o.p = &o.v
	return nil
}

func (o *optional[T]) String() string {
	if o == nil || o.std == nil {
		return ""
	}
	return o.std.Value.String()
}

// Placeholder is the standard flag's.
func (o *optional[T]) Placeholder() string { return Placeholder(o.std) }
