package configs

import (
	"strings"
	"testing"
	"time"
)

func TestElasticSection(t *testing.T) {
	c, err := Parse([]byte("elastic: {min_nodes: 2, max_nodes: 4, settle: 500ms, rejoin_timeout: 1m}\n"), "t")
	if err != nil {
		t.Fatal(err)
	}
	e := c.Elastic
	if e.MinNodes != 2 || e.MaxNodes != 4 || e.Settle != 500*time.Millisecond || e.RejoinTimeout != time.Minute || !e.KeepGlobalBatch {
		t.Fatalf("elastic = %+v (keep_global_batch defaults to true)", e)
	}
	if d := Default().Elastic; d.Enabled() || !d.KeepGlobalBatch {
		t.Fatalf("default elastic = %+v: off, keeping the global batch", d)
	}
	if _, err := Parse([]byte("elastic: {min_nodes: 2, max_node: 4}\n"), "cfg.yaml"); err == nil || !strings.Contains(err.Error(), "max_node") {
		t.Fatalf("unknown key: err = %v", err)
	}
	c.Elastic.MaxNodes = 1
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "elastic.max_nodes: must be >= min_nodes (2), got 1") {
		t.Fatalf("err = %v", err)
	}
}
