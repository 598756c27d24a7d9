package job

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/bench"
	"github.com/qvd/qvd/internal/half"
	"github.com/qvd/qvd/launch"
)

// TestBench runs a two-rank all-reduce benchmark in this process over TCP: rank 0
// coordinates and reports, rank 1 joins it; every element checks out.
func TestBench(t *testing.T) {
	port, err := launch.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	raw := make([]byte, 32)
	_, _ = rand.Read(raw)
	key := hex.EncodeToString(raw)
	getenv := func(k string) string { return map[string]string{ClusterKeyEnv: key}[k] }
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	coord := fmt.Sprintf("127.0.0.1:%d", port)
	spec := bench.Spec{Coll: bench.Collectives["allreduce"], Wire: half.FP32, Iters: 2, Warmup: 1}
	var out [2]bytes.Buffer
	errs := make(chan error, 2)
	for rank := range 2 {
		o := BenchOptions{Spec: spec, Sizes: []int64{4 << 10, 64 << 10}, World: 2, Transport: collective.TransportTCP,
			Member: MemberOptions{Bind: coord, GRPCBind: "127.0.0.1:0", NodeName: fmt.Sprintf("bench-%03d", rank), Getenv: getenv},
			Stdout: &out[rank], Stderr: io.Discard}
		if rank > 0 {
			o.Join, o.Member.Bind = coord, "127.0.0.1:0"
		}
		go func() { errs <- Bench(ctx, o) }()
	}
	for range 2 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	report := out[0].String() + out[1].String()
	if !strings.Contains(report, "all-reduce") || !strings.Contains(report, "Avg bus bandwidth") || strings.Count(report, "65536") != 1 {
		t.Errorf("report:\n%s", report)
	}
	if !strings.Contains(out[0].String(), "Avg bus bandwidth") {
		t.Errorf("rank 0 did not report:\n%s", report)
	}
}
