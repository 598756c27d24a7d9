package main

import (
	"strings"
	"testing"

	"github.com/qvd/qvd/collective/bench"
)

// benchRows returns the data lines of a table, split into fields, failing the test when the
// table is malformed (see ParseTable).
func benchRows(t *testing.T, table string) [][]string {
	t.Helper()
	rows, err := bench.ParseTable(table)
	if err != nil {
		t.Fatal(err)
	}
	return rows
}

// TestBenchBinary runs `qvd bench` as the launcher with real worker processes on each
// transport: the table comes through with every element right.
func TestBenchBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("starts worker processes")
	}
	t.Setenv(asQVD, "1") // the launcher's children run this test binary as qvd
	for _, c := range []struct{ coll, transport string }{{"reducescatter", "tcp"}, {"allgather", "grpc"}} {
		code, stdout, stderr := runQVD(t, "bench", c.coll, "--nproc", "2", "--transport", c.transport,
			"--sizes", "4K,64KiB", "--iters", "2", "--warmup", "1", "--dtype", "bf16")
		if code != exitOK {
			t.Fatalf("%s over %s: exit %d\nstdout:\n%s\nstderr:\n%s", c.coll, c.transport, code, stdout, stderr)
		}
		var table strings.Builder
		for _, line := range strings.Split(stdout, "\n") {
			if l, ok := strings.CutPrefix(line, "[rank 0] "); ok {
				table.WriteString(l + "\n")
			}
		}
		rows := benchRows(t, table.String())
		if len(rows) != 2 {
			t.Fatalf("%s over %s: %d rows, want 2:\n%s", c.coll, c.transport, len(rows), stdout)
		}
		for _, f := range rows {
			if f[8] != "0" || f[12] != "0" {
				t.Errorf("%s over %s: row %v has wrong elements", c.coll, c.transport, f)
			}
		}
	}
}

func TestBenchBadArgs(t *testing.T) {
	for _, args := range [][]string{
		{"bench"}, {"bench", "alltoall"}, {"bench", "allreduce", "--sizes", "1x"},
		{"bench", "allreduce", "--sizes", "0"}, {"bench", "broadcast", "--nproc", "2", "--root", "2"},
		{"bench", "allgather", "--transport", "mpi"},
	} {
		if code, _, _ := runQVD(t, args...); code != exitUsage {
			t.Errorf("%v: exit %d, want %d", args, code, exitUsage)
		}
	}
}
