package cluster

import (
	"strings"
	"testing"

	"github.com/hashicorp/memberlist"
)

// TestMetaWithMemoryFits: a member's metadata with every progress figure at its largest
// (step, model bytes, RSS, phase peak), the longest version, job and TLS fingerprint and
// IPv4 addresses fits memberlist's limit. (Maximal 128-byte host names do not leave room for
// all of them: encode refuses such metadata with ErrMetaTooLarge, and setProgress then keeps
// the last metadata that fitted.)
func TestMetaWithMemoryFits(t *testing.T) {
	m := Meta{
		Version: strings.Repeat("9", maxVersionLen), Role: RoleCoordinator, Job: strings.Repeat("j", maxJobLen),
		GRPC: "255.255.255.255:65535", Data: "255.255.255.255:65534", Devices: maxDevices,
		Memory: ^uint64(0), Gen: ^uint64(0), Rank: MaxWorld - 1, Step: 1<<63 - 1,
		ModelBytes: ^uint64(0), RSS: ^uint64(0), Peak: ^uint64(0), TLS: strings.Repeat("f", fingerprintLen),
	}
	b, err := m.encode()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d bytes (limit %d)", len(b), memberlist.MetaMaxSize)
	back, err := decodeMeta(b)
	if err != nil || back != m {
		t.Fatalf("round trip: %+v, %v", back, err)
	}
}
