package offload

import (
	"testing"
)

// TestHostStream: transfers run in order, Wait(t) returns only once transfer t is done, and
// Accumulate adds.
func TestHostStream(t *testing.T) {
	s := NewHostStream(2)
	defer s.Close()
	const n = 1 << 16
	host := make([]float32, n)
	dev := make([]float32, n)
	var last Ticket
	for k := 1; k <= 10; k++ {
		for i := range dev {
			dev[i] = float32(k)
		}
		last = s.Accumulate(host, dev)
		s.Wait(last) // dev is reused next round: the transfer must be done with it
	}
	for i, v := range host {
		if v != 55 {
			t.Fatalf("host[%d] = %v after accumulating 1..10, want 55", i, v)
		}
	}
	out := make([]float32, n)
	tk := s.Copy(out, host)
	s.Wait(tk)
	if out[n-1] != 55 || tk <= last {
		t.Fatalf("copy: %v, ticket %d after %d", out[n-1], tk, last)
	}
	s.Sync()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
}

func TestHostStreamLengthMismatch(t *testing.T) {
	s := NewHostStream(1)
	defer s.Close()
	defer func() {
		if recover() == nil {
			t.Fatal("a transfer between buffers of different lengths was accepted")
		}
	}()
	s.Copy(make([]float32, 3), make([]float32, 4))
}
