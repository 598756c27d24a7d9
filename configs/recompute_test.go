package configs

import (
	"strings"
	"testing"
)

func TestParseActivationCheckpointing(t *testing.T) {
	c, err := Parse([]byte("model:\n  hidden: [64, 32]\n  activation_checkpointing:\n    segments: 3\n"), "t")
	if err != nil {
		t.Fatal(err)
	}
	if got := c.Model.Recompute.Segments; got != 3 {
		t.Fatalf("segments = %d, want 3", got)
	}
	c.Model.Recompute.Segments = 4 // the MLP has 3 weight layers
	err = c.Validate()
	if err == nil || !strings.Contains(err.Error(), "model.activation_checkpointing.segments:") {
		t.Fatalf("Validate: %v, want an error naming model.activation_checkpointing.segments", err)
	}
	if _, err := Parse([]byte("model:\n  activation_checkpointing:\n    segmnts: 2\n"), "t"); err == nil || !strings.Contains(err.Error(), "segmnts") {
		t.Fatalf("unknown key: %v", err)
	}
}
