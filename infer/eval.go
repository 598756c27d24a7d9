package infer

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"github.com/qvd/qvd/data"
	"github.com/qvd/qvd/model"
)

// evalBatch is how many samples one Forward call takes: its activations stay in the caches.
const evalBatch = 256

// Evaluate runs the model over the whole test split (a Model from Load).
func (m *Model) Evaluate() (*model.Confusion, error) {
	ds, classes := m.Test, m.Spec.Classes
	b := data.NewBatch(evalBatch, ds.SampleSize())
	logits := make([]float32, evalBatch*classes)
	conf := model.NewConfusion(classes)
	for start := 0; start < ds.N; start += evalBatch {
		n := min(evalBatch, ds.N-start)
		if err := ds.FillRange(b, start, n, m.Norm); err != nil {
			return nil, err
		}
		if err := model.Forward(logits, m.Spec, m.Layout, m.Params, b.X, n); err != nil {
			return nil, err
		}
		if err := conf.Add(logits, b.Y, n); err != nil {
			return nil, err
		}
	}
	return conf, nil
}

// Report is an evaluation's result, as qvd eval --json writes it.
type Report struct {
	Weights  string   `json:"weights"`
	Model    string   `json:"model"`
	Samples  int      `json:"samples"`
	Correct  int      `json:"correct"`
	Accuracy float64  `json:"accuracy"`
	Loss     float64  `json:"loss"`
	Classes  []string `json:"classes"`
	// Confusion[true][predicted] counts the samples of each label by prediction.
	Confusion [][]int `json:"confusion"`
}

// Report is conf's figures for m.
func (m *Model) Report(conf *model.Confusion) Report {
	r := Report{Weights: m.Weights, Model: m.Spec.String(), Samples: conf.N(), Correct: conf.Correct(),
		Accuracy: conf.Accuracy(), Loss: conf.Loss(), Classes: m.Names}
	for row := 0; row < conf.Classes; row++ {
		r.Confusion = append(r.Confusion, conf.Counts[row*conf.Classes:(row+1)*conf.Classes])
	}
	return r
}

// Print prints the summary and the confusion matrix, rows the true labels.
func (r Report) Print(w io.Writer) {
	fmt.Fprintf(w, "weights:  %s\nmodel:    %s\n", r.Weights, r.Model)
	fmt.Fprintf(w, "accuracy: %.4f (%d/%d)\nloss:     %.4f\n\n", r.Accuracy, r.Correct, r.Samples, r.Loss)
	width := 5
	for _, n := range r.Classes {
		width = max(width, len(n)+4)
	}
	fmt.Fprintf(w, "confusion matrix (rows: true class, columns: predicted)\n%*s", width, "")
	for c := range r.Classes {
		fmt.Fprintf(w, " %6d", c)
	}
	fmt.Fprintln(w)
	for c, row := range r.Confusion {
		fmt.Fprintf(w, "%-*s", width, fmt.Sprintf("%d %s", c, r.Classes[c]))
		for _, v := range row {
			fmt.Fprintf(w, " %6d", v)
		}
		fmt.Fprintln(w)
	}
}

// Eval loads the model and the test split o names and evaluates it (Load, Evaluate, Report).
func Eval(o Options) (Report, error) {
	m, err := Load(o)
	if err != nil {
		return Report{}, err
	}
	conf, err := m.Evaluate()
	if err != nil {
		return Report{}, err
	}
	return m.Report(conf), nil
}

// WriteJSON writes r as indented JSON to path (qvd eval --json).
func (r Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}
