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
	coord := startNode(t, "coord", RoleCoordinator)
	workers := []*testNode{startNode(t, "w1", RoleWorker), startNode(t, "w2", RoleWorker), startNode(t, "w3", RoleWorker)}
	for _, w := range workers {
		join(t, w, coord)
	}
	eventually(t, 3*time.Second, "all members visible", func() bool { return len(coord.Members()) == 4 })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for _, w := range workers {
		wg.Add(1)
		go func() { defer wg.Done(); _, _ = w.AwaitRoster(ctx) }()
	}
	prev, err := coord.Coordinate(ctx, "job-r", 4, []byte("cfg"))
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()

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
	rs[0], errs[0] = workers[0].Reform(ctx, prev)
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
	if _, err := workers[1].Reform(ctx, prev); err == nil {
		t.Fatal("w2 coordinated although w1, ranked lower, is alive")
	}
}
