package collective

import "testing"

// TestRecvBuffersFor: the receive pool holds recvBytes of pieces, within [4, 16] pieces.
func TestRecvBuffersFor(t *testing.T) {
	for _, c := range []struct {
		chunk int
		want  int64
	}{
		{512 << 10, 8}, // the default pieces: 4 MiB
		{2 << 20, 4},   // shm_chunk_bytes 2 MiB: 8 MiB, not 2 pieces
		{64 << 10, 16}, // small pieces: 1 MiB, not 64 pieces
		{1 << 20, 4},
		{1, 16},
		{1 << 30, 4},
	} {
		if got := recvBuffersFor(c.chunk); got != c.want {
			t.Errorf("pieces of %d bytes: %d buffers, want %d", c.chunk, got, c.want)
		}
	}
}
