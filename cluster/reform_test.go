package cluster

import (
	"context"
	"reflect"
	"sync"
	"testing"
	"time"
)

// TestReformAfterCoordinatorDies: a job of 4 loses its coordinator (rank 0); the
// lowest-ranked survivor, a worker, coordinates generation g+1 of the three that are left,
// and every survivor gets the same roster with the ranks in the old order.
func TestReformAfterCoordinatorDies(t *testing.T) {
	checkLeaks(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	coord, workers, prev := formedJob(t, ctx, "job-r")
	var wg sync.WaitGroup

	coord.srv.Stop()
	coord.kill()
	want := []string{"w1", "w2", "w3"}
	for _, w := range workers {
		eventually(t, 15*time.Second, w.LocalName()+" sees the coordinator gone", func() bool { return reflect.DeepEqual(w.Survivors(prev), want) })
	}
	rs := make([]*Roster, 3)
	errs := make([]error, 3)
	for i, w := range workers[1:] {
		wg.Add(1)
		go func() { defer wg.Done(); rs[i+1], errs[i+1] = w.AwaitRoster(ctx) }()
	}
	rs[0], errs[0] = workers[0].Reform(ctx, prev, nil, 64)
	wg.Wait()
	for i, r := range rs {
		if errs[i] != nil {
			t.Fatalf("%s: %v", want[i], errs[i])
		}
		var names []string
		for _, m := range r.Members {
			names = append(names, m.Name)
		}
		if r.Gen != prev.Gen+1 || r.Rank != i || r.World != 3 || !reflect.DeepEqual(names, want) || string(r.Config) != "cfg" {
			t.Fatalf("%s: roster gen %d (prev %d), rank %d, world %d, members %v", want[i], r.Gen, prev.Gen, r.Rank, r.World, names)
		}
	}
	if _, err := workers[1].Reform(ctx, prev, nil, 64); err == nil {
		t.Fatal("w2 coordinated although w1, ranked lower, is alive")
	}
}

// TestReformLeavesOutTheGone: the coordinator re-forms at once, before gossip declares
// anyone dead. A member whose server refuses the connection (killed) is left out on the
// first attempt instead of holding the re-form for a call timeout; a member that another
// survivor reports gone (Suspect, carried in its Prepare ack) is left out too, and every
// member of the committed roster gets the same one.
func TestReformLeavesOutTheGone(t *testing.T) {
	checkLeaks(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	coord, workers, prev := formedJob(t, ctx, "job-g")
	var wg sync.WaitGroup

	reform := func(prev *Roster, awaiting []*testNode, want []string) *Roster {
		t.Helper()
		rs := make([]*Roster, len(awaiting))
		errs := make([]error, len(awaiting))
		for i, w := range awaiting {
			wg.Add(1)
			go func() { defer wg.Done(); rs[i], errs[i] = w.AwaitRoster(ctx) }()
		}
		start := time.Now()
		r, err := coord.Reform(ctx, prev, nil, 64)
		if err != nil {
			t.Fatal(err)
		}
		if took := time.Since(start); took > reformCallTimeout {
			t.Errorf("the re-form took %v, more than one call timeout (%v)", took, reformCallTimeout)
		}
		wg.Wait()
		for i, got := range append([]*Roster{r}, rs...) {
			if i > 0 && errs[i-1] != nil {
				t.Fatalf("%s: %v", awaiting[i-1].LocalName(), errs[i-1])
			}
			var names []string
			for _, m := range got.Members {
				names = append(names, m.Name)
			}
			if got.Gen != prev.Gen+1 || got.Rank != i || !reflect.DeepEqual(names, want) {
				t.Fatalf("roster %d: gen %d (prev %d), rank %d, members %v, want %v", i, got.Gen, prev.Gen, got.Rank, names, want)
			}
		}
		return r
	}

	// w3 is killed; gossip still reports it alive.
	workers[2].srv.Stop()
	workers[2].kill()
	if !reflect.DeepEqual(coord.Survivors(prev), []string{"coord", "w1", "w2", "w3"}) {
		t.Skip("gossip already declared w3 gone: nothing left to test")
	}
	// A member's own evidence drops a member only when its server refuses connections.
	if got := workers[0].SurvivorsExcept(ctx, prev, []string{"w3", "w2"}); !reflect.DeepEqual(got, []string{"coord", "w1", "w2"}) {
		t.Fatalf("SurvivorsExcept(w3 killed, w2 serving) = %v", got)
	}
	r1 := reform(prev, workers[:2], []string{"coord", "w1", "w2"})

	// w1's collectives found w2 gone (w2 is in fact alive): the coordinator follows w1.
	workers[0].Suspect(r1.Job, r1.Gen, []string{"w2"})
	reform(r1, workers[:1], []string{"coord", "w1"})
}

// formedJob starts a coordinator and workers w1-w3, and forms a job of the four of them: it
// returns the nodes and generation 0's roster.
func formedJob(t *testing.T, ctx context.Context, job string) (*testNode, []*testNode, *Roster) {
	t.Helper()
	coord := startNode(t, "coord", RoleCoordinator)
	workers := []*testNode{startNode(t, "w1", RoleWorker), startNode(t, "w2", RoleWorker), startNode(t, "w3", RoleWorker)}
	for _, w := range workers {
		join(t, w, coord)
	}
	eventually(t, 3*time.Second, "all members visible", func() bool { return len(coord.Members()) == 4 })
	var wg sync.WaitGroup
	for _, w := range workers {
		wg.Add(1)
		go func() { defer wg.Done(); _, _ = w.AwaitRoster(ctx) }()
	}
	prev, err := coord.Coordinate(ctx, job, 4, []byte("cfg"))
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	return coord, workers, prev
}

// TestReformAdmitsNewcomers: a worker that joins the cluster while a job runs is a newcomer
// of that job; a re-form with room admits it after the survivors (ranks in the old order,
// the newcomer last), and one at the largest world leaves it waiting.
func TestReformAdmitsNewcomers(t *testing.T) {
	checkLeaks(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	coord, workers, prev := formedJob(t, ctx, "job-n")
	w4 := startNode(t, "w4", RoleWorker)
	join(t, w4, coord)
	eventually(t, 10*time.Second, "the coordinator sees w4 as a newcomer", func() bool {
		return reflect.DeepEqual(memberNames(coord.Newcomers(prev)), []string{"w4"})
	})
	obs := startNode(t, "obs", RoleObserver)
	join(t, obs, coord)
	eventually(t, 10*time.Second, "the coordinator sees the observer", func() bool { return len(coord.Members()) == 6 })
	if got := memberNames(coord.Newcomers(prev)); !reflect.DeepEqual(got, []string{"w4"}) {
		t.Fatalf("Newcomers = %v, want [w4] (an observer never joins a job)", got)
	}

	awaiting := append(append([]*testNode(nil), workers...), w4)
	rs := make([]*Roster, len(awaiting))
	errs := make([]error, len(awaiting))
	var wg sync.WaitGroup
	for i, w := range awaiting {
		wg.Add(1)
		go func() { defer wg.Done(); rs[i], errs[i] = w.AwaitRoster(ctx) }()
	}
	r, err := coord.Reform(ctx, prev, nil, 5)
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	want := []string{"coord", "w1", "w2", "w3", "w4"}
	for i, got := range append([]*Roster{r}, rs...) {
		if i > 0 && errs[i-1] != nil {
			t.Fatalf("%s: %v", want[i], errs[i-1])
		}
		var names []string
		for _, m := range got.Members {
			names = append(names, m.Name)
		}
		if got.Gen != prev.Gen+1 || got.Rank != i || !reflect.DeepEqual(names, want) {
			t.Fatalf("roster %d: gen %d (prev %d), rank %d, members %v, want %v", i, got.Gen, prev.Gen, got.Rank, names, want)
		}
	}
	if n := coord.Newcomers(r); len(n) != 0 {
		t.Fatalf("after admission, Newcomers = %v", memberNames(n))
	}

	// At the largest world nobody is admitted: the roster keeps the members it has.
	w5 := startNode(t, "w5", RoleWorker)
	join(t, w5, coord)
	eventually(t, 10*time.Second, "the coordinator sees w5", func() bool { return len(coord.Newcomers(r)) == 1 })
	for i, w := range awaiting {
		wg.Add(1)
		go func() { defer wg.Done(); rs[i], errs[i] = w.AwaitRoster(ctx) }()
	}
	r2, err := coord.Reform(ctx, r, nil, 5)
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if r2.World != 5 || r2.Members[4].Name != "w4" {
		t.Fatalf("at max_nodes 5 the re-form gave world %d (%v)", r2.World, r2.Members)
	}
}
