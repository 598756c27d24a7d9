package cli

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
)

// ErrShell is Completion's error for a shell other than bash and zsh.
var ErrShell = errors.New("completion: give bash or zsh")

// Completion writes prog's completion script for shell: the commands, each one's first
// argument (Command.Args) and its visible flags, which flagsOf returns (nil for none).
func Completion(w io.Writer, prog, shell string, cmds []Command, flagsOf func(Command) *flag.FlagSet) error {
	if shell != "bash" && shell != "zsh" {
		return ErrShell
	}
	var names []string
	for _, c := range cmds {
		names = append(names, c.Name)
	}
	flags := func(c Command) []string {
		fs := flagsOf(c)
		if fs == nil {
			return nil
		}
		var out []string
		for _, f := range VisibleFlags(c, fs) {
			if len(f.Name) == 1 {
				out = append(out, "-"+f.Name)
			} else {
				out = append(out, "--"+f.Name)
			}
		}
		return out
	}
	var b strings.Builder
	if shell == "bash" {
		fmt.Fprintf(&b, "# bash completion for %[1]s: source <(%[1]s completion bash)\n_%[1]s() {\n", prog)
		fmt.Fprintf(&b, "    local cur=\"${COMP_WORDS[COMP_CWORD]}\" words=\"\"\n")
		fmt.Fprintf(&b, "    if [[ $COMP_CWORD -eq 1 ]]; then\n        COMPREPLY=($(compgen -W %q -- \"$cur\"))\n        return\n    fi\n", strings.Join(names, " "))
		fmt.Fprintf(&b, "    case \"${COMP_WORDS[1]}\" in\n")
		for _, c := range cmds {
			fmt.Fprintf(&b, "    %s)\n", c.Name)
			if len(c.Args) > 0 {
				fmt.Fprintf(&b, "        if [[ $COMP_CWORD -eq 2 ]]; then words=%q; fi\n", strings.Join(c.Args, " "))
			}
			if f := flags(c); len(f) > 0 {
				fmt.Fprintf(&b, "        if [[ $cur == -* ]]; then words=%q; fi\n", strings.Join(f, " "))
			}
			fmt.Fprintf(&b, "        ;;\n")
		}
		fmt.Fprintf(&b, "    esac\n")
		fmt.Fprintf(&b, "    if [[ -n $words ]]; then\n        COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))\n    else\n        COMPREPLY=($(compgen -f -- \"$cur\"))\n    fi\n}\n")
		fmt.Fprintf(&b, "complete -o default -F _%[1]s %[1]s\n", prog)
	} else {
		fmt.Fprintf(&b, "#compdef %[1]s\n# zsh completion for %[1]s: %[1]s completion zsh > \"${fpath[1]}/_%[1]s\"\n_%[1]s() {\n", prog)
		fmt.Fprintf(&b, "    local -a words_\n")
		fmt.Fprintf(&b, "    if (( CURRENT == 2 )); then\n        compadd -- %s\n        return\n    fi\n", strings.Join(names, " "))
		fmt.Fprintf(&b, "    case ${words[2]} in\n")
		for _, c := range cmds {
			fmt.Fprintf(&b, "    %s)\n", c.Name)
			if len(c.Args) > 0 {
				fmt.Fprintf(&b, "        if (( CURRENT == 3 )); then words_=(%s); fi\n", strings.Join(c.Args, " "))
			}
			if f := flags(c); len(f) > 0 {
				fmt.Fprintf(&b, "        if [[ $PREFIX == -* ]]; then words_=(%s); fi\n", strings.Join(f, " "))
			}
			fmt.Fprintf(&b, "        ;;\n")
		}
		fmt.Fprintf(&b, "    esac\n")
		fmt.Fprintf(&b, "    if (( ${#words_} )); then\n        compadd -- $words_\n    else\n        _files\n    fi\n}\n_%s \"$@\"\n", prog)
	}
	_, err := io.WriteString(w, b.String())
	return err
}
