package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestRendezvous: a coordinator and three workers (named so that join order, name order
// and start order all differ) reach one roster, identical on every member but for Rank,
// with ranks by name, the config bytes and one data secret. An observer in the cluster is
// not given a rank.
func TestRendezvous(t *testing.T) {
	checkLeaks(t)
	coord := startNode(t, "coord", RoleCoordinator)
	workers := []*testNode{
		startNode(t, "w-c", RoleWorker),
		startNode(t, "w-a", RoleWorker),
		startNode(t, "w-b", RoleWorker),
	}
	obs := startNode(t, "a-observer", RoleObserver)
	join(t, obs, coord)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	type result struct {
		r   *Roster
		err error
	}
	results := make([]result, len(workers))
	var wg sync.WaitGroup
	for i, w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := w.Join(ctx, coord.LocalAddr()); err != nil {
				results[i].err = err
				return
			}
			results[i].r, results[i].err = w.AwaitRoster(ctx)
		}()
	}
	config := []byte("model: tiny\nsteps: 10\n")
	start := time.Now()
	cr, err := coord.Coordinate(ctx, "job-1", 4, config)
	if err != nil {
		t.Fatalf("Coordinate: %v", err)
	}
	wg.Wait()
	t.Logf("rendezvous of 4 took %v", time.Since(start).Round(time.Millisecond))

	wantNames := []string{"coord", "w-a", "w-b", "w-c"}
	check := func(who string, r *Roster, rank int) {
		t.Helper()
		var names []string
		for _, m := range r.Members {
			names = append(names, m.Name)
		}
		if !reflect.DeepEqual(names, wantNames) || r.World != 4 || r.Job != "job-1" || r.Rank != rank {
			t.Errorf("%s: roster %v world %d job %s rank %d; want %v, rank %d", who, names, r.World, r.Job, r.Rank, wantNames, rank)
		}
		if !bytes.Equal(r.Config, config) {
			t.Errorf("%s: config %q", who, r.Config)
		}
		if len(r.Secret) != secretLen {
			t.Errorf("%s: secret of %d bytes", who, len(r.Secret))
		}
	}
	check("coord", cr, 0)
	for i, w := range workers {
		if results[i].err != nil {
			t.Fatalf("%s: %v", w.LocalName(), results[i].err)
		}
		r := results[i].r
		check(w.LocalName(), r, r.RankOf(w.LocalName()))
		// Identical on every member but for Rank.
		same := r.Clone()
		same.Rank = 0
		if !reflect.DeepEqual(same, cr) {
			t.Errorf("%s's roster differs from the coordinator's:\n%+v\n%+v", w.LocalName(), same, cr)
		}
	}
	if cr.Members[1].GRPC != workers[1].LocalMeta().GRPC || cr.Members[1].Gen != workers[1].LocalMeta().Gen {
		t.Errorf("rank 1 entry %+v does not describe w-a", cr.Members[1])
	}

	// Ranks and the job spread by gossip; the observer has none.
	eventually(t, 3*time.Second, "ranks visible to the observer", func() bool {
		ranks := map[string]int{}
		for _, m := range obs.Members() {
			ranks[m.Name] = m.Meta.Rank
			if m.Meta.Rank >= 0 && m.Meta.Job != "job-1" {
				return false
			}
		}
		return reflect.DeepEqual(ranks, map[string]int{"coord": 0, "w-a": 1, "w-b": 2, "w-c": 3, "a-observer": -1})
	})
}

// TestRendezvousMoreCandidatesThanWorld: extra workers are left out, deterministically.
func TestRendezvousMoreCandidatesThanWorld(t *testing.T) {
	checkLeaks(t)
	coord := startNode(t, "coord", RoleCoordinator)
	var ws []*testNode
	for _, name := range []string{"w2", "w1", "w3"} {
		w := startNode(t, name, RoleWorker)
		join(t, w, coord)
		ws = append(ws, w)
	}
	eventually(t, 3*time.Second, "all members visible", func() bool { return len(coord.Members()) == 4 })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var w1r *Roster
	wg.Add(1)
	go func() {
		defer wg.Done()
		w1r, _ = ws[1].AwaitRoster(ctx)
	}()
	r, err := coord.Coordinate(ctx, "job-2", 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if got := []string{r.Members[0].Name, r.Members[1].Name, r.Members[2].Name}; !reflect.DeepEqual(got, []string{"coord", "w1", "w2"}) {
		t.Errorf("roster %v", got)
	}
	if w1r == nil || w1r.Rank != 1 {
		t.Errorf("w1 got %+v", w1r)
	}
}

// TestRendezvousTimeout: the error lists who is present, who does not count and why, and
// how many are missing; a waiting worker names the coordinator it sees.
func TestRendezvousTimeout(t *testing.T) {
	checkLeaks(t)
	coord := startNode(t, "coord", RoleCoordinator, withRendezvous(700*time.Millisecond))
	w := startNode(t, "w1", RoleWorker, withRendezvous(700*time.Millisecond))
	obs := startNode(t, "obs", RoleObserver)
	join(t, w, coord)
	join(t, obs, coord)
	eventually(t, 3*time.Second, "all members visible", func() bool { return len(coord.Members()) == 3 })

	ctx := context.Background()
	var wg sync.WaitGroup
	var awaitErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		_, awaitErr = w.AwaitRoster(ctx)
	}()
	_, err := coord.Coordinate(ctx, "job-3", 4, nil)
	wg.Wait()
	if !errors.Is(err, ErrRendezvousTimeout) {
		t.Fatalf("Coordinate: got %v, want ErrRendezvousTimeout", err)
	}
	t.Logf("coordinator: %v", err)
	for _, want := range []string{
		"2 of 4 members present", "2 missing",
		fmt.Sprintf("coord (%s)", coord.LocalAddr()), fmt.Sprintf("w1 (%s)", w.LocalAddr()),
		fmt.Sprintf("obs (%s): role observer", obs.LocalAddr()),
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error lacks %q", want)
		}
	}
	if !errors.Is(awaitErr, ErrRendezvousTimeout) || !strings.Contains(awaitErr.Error(), "coord ("+coord.LocalAddr()+", job job-3") {
		t.Errorf("AwaitRoster: %v", awaitErr)
	}
	t.Logf("worker: %v", awaitErr)

	// Alone, a worker says it sees no coordinator.
	lone := startNode(t, "lone", RoleWorker, withRendezvous(200*time.Millisecond))
	if _, err := lone.AwaitRoster(ctx); !errors.Is(err, ErrRendezvousTimeout) || !strings.Contains(err.Error(), "no coordinator is visible") {
		t.Errorf("lone worker: %v", err)
	}
	// Wrong roles.
	if _, err := w.Coordinate(ctx, "job-3", 2, nil); !errors.Is(err, ErrWrongRole) {
		t.Errorf("Coordinate on a worker: %v", err)
	}
	if _, err := obs.AwaitRoster(ctx); !errors.Is(err, ErrWrongRole) {
		t.Errorf("AwaitRoster on an observer: %v", err)
	}
}

// TestRendezvousRetriesLostWorker: a worker that dies after being picked (its gRPC server
// gone) makes the attempt fail; the coordinator retries with the membership as it then is.
func TestRendezvousRetriesLostWorker(t *testing.T) {
	checkLeaks(t)
	coord := startNode(t, "coord", RoleCoordinator)
	w1 := startNode(t, "w1", RoleWorker)
	w2 := startNode(t, "w2", RoleWorker)
	w3 := startNode(t, "w3", RoleWorker)
	for _, w := range []*testNode{w1, w2, w3} {
		join(t, w, coord)
	}
	eventually(t, 3*time.Second, "all members visible", func() bool { return len(coord.Members()) == 4 })
	// w1 is first by name; its process dies without a word.
	w1.srv.Stop()
	w1.kill()

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	rs := make([]*Roster, 2)
	for i, w := range []*testNode{w2, w3} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rs[i], _ = w.AwaitRoster(ctx)
		}()
	}
	r, err := coord.Coordinate(ctx, "job-4", 3, nil)
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if got := []string{r.Members[1].Name, r.Members[2].Name}; !reflect.DeepEqual(got, []string{"w2", "w3"}) {
		t.Errorf("roster after losing w1: %v", got)
	}
	for i, x := range rs {
		if x == nil || x.Gen != r.Gen || x.Rank != i+1 {
			t.Errorf("worker %d got %+v, coordinator gen %d", i+2, x, r.Gen)
		}
	}
}

func TestRendezvousWorldOne(t *testing.T) {
	checkLeaks(t)
	coord := startNode(t, "coord", RoleCoordinator)
	r, err := coord.Coordinate(context.Background(), "solo", 1, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	if r.World != 1 || r.Rank != 0 || r.Members[0].Name != "coord" || coord.LocalMeta().Rank != 0 {
		t.Errorf("roster %+v, meta %+v", r, coord.LocalMeta())
	}
	if _, err := coord.Coordinate(context.Background(), "bad job", 1, nil); err == nil {
		t.Error("a job id with a space was accepted")
	}
}
