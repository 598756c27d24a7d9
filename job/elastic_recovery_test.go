package job

import (
	"errors"
	"fmt"
	"reflect"
	"testing"
	"time"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/metrics"
)

// TestGoneMembers: a lost connection and gossip's verdict name a member to leave out of the
// next generation; a timeout, an abort relayed by another rank and this rank's own failure
// name no one.
func TestGoneMembers(t *testing.T) {
	prev := &cluster.Roster{Rank: 1, Members: []cluster.RosterMember{{Name: "a"}, {Name: "b"}, {Name: "c"}}}
	for _, c := range []struct {
		err  error
		want []string
	}{
		{fmt.Errorf("step 3: %w", &collective.PeerError{Rank: 2, Err: fmt.Errorf("connection closed: %w", collective.ErrPeerGone)}), []string{"c"}},
		{fmt.Errorf("%w: %w", ErrMemberLost, &memberFailed{rank: 0, name: "a"}), []string{"a"}},
		{&collective.PeerError{Rank: 2, Err: collective.ErrTimeout}, nil},
		{&collective.PeerError{Rank: 2, Err: collective.ErrAborted}, nil},
		{&collective.PeerError{Rank: 1, Err: collective.ErrPeerGone}, nil}, // this rank
		{&collective.PeerError{Rank: 7, Err: collective.ErrPeerGone}, nil},
		{&memberFailed{rank: 5, name: "stranger"}, nil},
		{errors.New("disk full"), nil},
	} {
		if got := goneMembers(c.err, prev); !reflect.DeepEqual(got, c.want) {
			t.Errorf("goneMembers(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

type recordList []metrics.Record

func (l *recordList) Write(r metrics.Record) error { *l = append(*l, r); return nil }

// TestReformSinkResumeSeconds: the re-form's record is written just before the first train
// record of the new generation, with resume_seconds from the loss to then; a run that ends
// before any step writes it without.
func TestReformSinkResumeSeconds(t *testing.T) {
	var got recordList
	s := &reformSink{next: &got, lost: time.Now().Add(-2 * time.Second)}
	s.hold(metrics.Record{Kind: metrics.KindEvent, Event: metrics.EventReform, ResumeSeconds: 0.1}, &got)
	_ = s.Write(metrics.Record{Kind: metrics.KindEvent, Event: "other"})
	_ = s.Write(metrics.Record{Kind: metrics.KindTrain, Step: 5})
	_ = s.Write(metrics.Record{Kind: metrics.KindTrain, Step: 6})
	if err := flushReform(s); err != nil {
		t.Fatal(err)
	}
	if len(got) != 4 || got[1].Event != metrics.EventReform || got[2].Step != 5 || got[1].ResumeSeconds < 2 {
		t.Fatalf("records %+v", got)
	}

	got = nil
	s = &reformSink{next: &got, lost: time.Now()}
	s.hold(metrics.Record{Kind: metrics.KindEvent, Event: metrics.EventReform, ResumeSeconds: 0.1}, &got)
	if err := flushReform(s); err != nil || len(got) != 1 || got[0].ResumeSeconds != 0 {
		t.Fatalf("flushed %+v, %v", got, err)
	}
	if err := flushReform(nil); err != nil {
		t.Fatal(err)
	}
}
