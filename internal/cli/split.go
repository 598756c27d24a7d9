package cli

import (
	"flag"
	"strings"
)

// SplitKnown separates a command's own flags, which come first, from the arguments it passes
// on (qvd launch hands the rest to qvd train): own runs up to the first argument that is not
// a flag fs defines (with its value), -h or -help. A bool flag of fs takes no value.
func SplitKnown(fs *flag.FlagSet, args []string) (own, rest []string) {
	takes := func(name string) (known, value bool) {
		f := fs.Lookup(name)
		if f == nil {
			return false, false
		}
		b, isBool := f.Value.(interface{ IsBoolFlag() bool })
		return true, !isBool || !b.IsBoolFlag()
	}
	for i := 0; i < len(args); i++ {
		a := args[i]
		name := strings.TrimLeft(a, "-")
		if eq := strings.IndexByte(name, '='); eq >= 0 {
			name = name[:eq]
			if known, _ := takes(name); known {
				own = append(own, a)
				continue
			}
		} else if known, value := takes(name); known && strings.HasPrefix(a, "-") {
			own = append(own, a)
			if value && i+1 < len(args) {
				own = append(own, args[i+1])
				i++
			}
			continue
		}
		if name == "h" || name == "help" {
			own = append(own, a)
			continue
		}
		return own, args[i:]
	}
	return own, nil
}
