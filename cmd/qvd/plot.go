package main

import (
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/qvd/qvd/internal/metrics"
	"github.com/qvd/qvd/internal/plot"
)

func cmdPlot(args []string, stdout, stderr io.Writer) int {
	fs := newFlagSet("plot")
	out := fs.String("o", "", "PNG to write (default: curves.png beside the metrics file)")
	csv := fs.String("csv", "", "also write the metrics as CSV to this file")
	title := fs.String("title", "", "chart title (default: the run directory's name)")
	path, code, ok := parseOneArg(fs, args, stdout, stderr)
	if !ok {
		return code
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		path = filepath.Join(path, "metrics.jsonl")
	}
	recs, err := metrics.ReadFile(path)
	if err != nil {
		fmt.Fprintf(stderr, "qvd plot: %v\n", err)
		return exitFailure
	}
	if *out == "" {
		*out = filepath.Join(filepath.Dir(path), "curves.png")
	}
	if *title == "" {
		*title = filepath.Base(filepath.Dir(path))
	}
	opt := plot.DefaultOptions()
	opt.Title = *title
	if err := plot.Render(recs, *out, opt); err != nil {
		fmt.Fprintf(stderr, "qvd plot: %v\n", err)
		return exitFailure
	}
	fmt.Fprintf(stdout, "wrote %s (%d records)\n", *out, len(recs))
	if *csv != "" {
		f, err := os.Create(*csv)
		if err == nil {
			err = metrics.WriteCSV(f, recs)
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			fmt.Fprintf(stderr, "qvd plot: writing CSV: %v\n", err)
			return exitFailure
		}
		fmt.Fprintf(stdout, "wrote %s\n", *csv)
	}
	return exitOK
}
