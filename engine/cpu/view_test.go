package cpu_test

import (
	"testing"

	"github.com/qvd/qvd/engine"
	"github.com/qvd/qvd/engine/cpu"
)

// Two views of the same memory (a net rebuilt at a smaller micro-batch views the parameters
// before the old net closes): ending the first leaves the second usable.
func TestViewsCounted(t *testing.T) {
	d := cpu.New(cpu.Options{Threads: 1})
	defer d.Close()
	x := []float32{1, 2, 3, 4}
	a := d.View(x)
	b := d.View(x)
	d.Unview(a)
	d.Fill(b, 7)
	if err := d.Sync(); err != nil {
		t.Fatalf("the second view died with the first: %v", err)
	}
	if x[3] != 7 {
		t.Fatalf("fill through the second view: %v", x)
	}
	d.Unview(b)
	d.Fill(b, 1)
	if err := d.Sync(); err == nil {
		t.Fatal("a buffer whose views have all ended is still usable")
	}
	var _ engine.HostMemory = d
}
