package launch

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestResumeCommand(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-c", "fashion-mlp", "--out", "runs/x"}, "qvd train -c fashion-mlp --out runs/x --resume auto"},
		{[]string{"--out", "my runs/it's", "--resume", "/ck/step-1", "--lr=0.01"}, `qvd train --out 'my runs/it'\''s' --lr=0.01 --resume auto`},
		{[]string{"--resume=auto", "--quiet", "-resume", "x", "--epochs", "2"}, "qvd train --quiet --epochs 2 --resume auto"},
		{[]string{"--data", ""}, "qvd train --data '' --resume auto"},
		{[]string{"--overwrite=true", "--out", "r", "--overwrite"}, "qvd train --out r --resume auto"},
	} {
		if got := ResumeCommand("qvd train", c.args); got != c.want {
			t.Errorf("ResumeCommand(%q) = %s, want %s", c.args, got, c.want)
		}
	}
}

// TestPrepare: a fresh key goes into the environment only when none is given; the workers
// get their share of the cores; a master address that does not resolve is ErrMasterAddr.
func TestPrepare(t *testing.T) {
	const keyEnv = "TEST_KEY"
	n := Nodes{Host: "127.0.0.1", NNodes: 1}
	none := func(string) string { return "" }
	env, p, err := n.Prepare(context.Background(), "", keyEnv, 2, []string{"A=1"}, none)
	if err != nil || p.Coord == "" {
		t.Fatalf("%v, %+v", err, p)
	}
	if !slices.ContainsFunc(env, func(e string) bool { return strings.HasPrefix(e, keyEnv+"=") && len(e) == len(keyEnv)+1+64 }) || env[0] != "A=1" {
		t.Errorf("no fresh key: %q", env)
	}
	for _, give := range []struct {
		file   string
		getenv func(string) string
	}{{"cluster.key", none}, {"", func(k string) string { return map[string]string{keyEnv: "k"}[k] }}} {
		env, _, err := n.Prepare(context.Background(), give.file, keyEnv, 2, nil, give.getenv)
		if err != nil || slices.ContainsFunc(env, func(e string) bool { return strings.HasPrefix(e, keyEnv+"=") }) {
			t.Errorf("key given (%q): %v, env %q", give.file, err, env)
		}
	}
	bad := Nodes{NNodes: 2, MasterAddr: "no-such-host.invalid", MasterPort: 29500}
	if _, _, err := bad.Prepare(context.Background(), "k", keyEnv, 1, nil, none); !errors.Is(err, ErrMasterAddr) {
		t.Errorf("unresolvable master: %v", err)
	}
}

// TestBenchWorkers: global ranks by node, rank 0 coordinates, the others join it.
func TestBenchWorkers(t *testing.T) {
	b := Bench{Exe: "/bin/qvd", Env: []string{"E=1"}, Nodes: Nodes{NNodes: 2, NodeRank: 1}, NProc: 2,
		Place: Placement{Host: "10.0.0.2", Coord: "10.0.0.1:29500", CoordBind: "10.0.0.1:29500"}, Args: []string{"bench", "allreduce", "--serve"}}
	w := b.Workers()
	if len(w) != 2 || w[0].Rank != 2 || w[1].Rank != 3 {
		t.Fatalf("ranks: %+v", w)
	}
	got := strings.Join(w[0].Cmd.Args, " ")
	if want := "/bin/qvd bench allreduce --serve --node-name bench-002 --bind 10.0.0.2:0 --grpc-bind 10.0.0.2:0 --join 10.0.0.1:29500"; got != want || w[0].Cmd.Env[0] != "E=1" {
		t.Errorf("worker args %q\nwant %q", got, want)
	}
	b.Nodes.NodeRank = 0
	if a := strings.Join(b.Workers()[0].Cmd.Args, " "); strings.Contains(a, "--join") || !strings.Contains(a, "--bind 10.0.0.1:29500") {
		t.Errorf("rank 0: %q", a)
	}
}
