package zero

import "testing"

// TestAutoBuckets: the bucket sizes qvd picks when the config leaves them at 0.
func TestAutoBuckets(t *testing.T) {
	const mlp37 = 36_818_954 // bench/mlp-37m.yaml
	for _, c := range []struct {
		name                 string
		elems, world, stage  int
		wantReduce, wantGath int
	}{
		{"a 32nd of the model at stage 0", mlp37, 4, 0, 1_150_593, 1_150_593},
		{"stage 1 as stage 0", mlp37, 4, 1, 1_150_593, 1_150_593},
		{"a 64th of the model for stage 2's staged reduce", mlp37, 4, 2, 575_297, 1_150_593},
		{"at least 64 Ki per rank", 10_000_000, 4, 2, 262_144, 312_500},
		{"never more than the model", 1000, 4, 2, 1000, 1000},
		{"at most 25 MB", 2_000_000_000, 8, 2, 6_250_000, 6_250_000},
		{"one element", 1, 1, 2, 1, 1},
	} {
		r, g := Config{Stage: c.stage}.ResolveBuckets(c.elems, c.world)
		if r != c.wantReduce || g != c.wantGath {
			t.Errorf("%s: reduce %d, gather %d; want %d, %d", c.name, r, g, c.wantReduce, c.wantGath)
		}
		if want := AutoReduceBucketElems(c.elems, c.world, c.stage); r != want {
			t.Errorf("%s: ResolveBuckets' reduce %d, AutoReduceBucketElems %d", c.name, r, want)
		}
	}
	// A size the config sets is kept, whatever the stage.
	if r, g := (Config{Stage: 2, ReduceBucketSize: 5000, AllgatherBucketSize: 7000}).ResolveBuckets(mlp37, 4); r != 5000 || g != 7000 {
		t.Errorf("set sizes: %d, %d", r, g)
	}
}
