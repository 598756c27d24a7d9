package collective

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"time"
)

// ErrAuth: a peer could not prove it holds the job's secret.
var ErrAuth = errors.New("collective: peer authentication failed")

// Hello payload layout (the payload of a KindHello frame that opens every data connection):
//
//	0  rank      uint16
//	2  size      uint16
//	4  unix nano int64   (sender's clock; rejected outside HelloWindow)
//	12 nonce     [16]byte
//	28 mac       [32]byte HMAC-SHA256(secret, "qvd-hello-v1" | job | bytes[0:28])
const (
	helloSize = 60
	// HelloWindow bounds clock skew plus delivery time for a hello, limiting replays.
	HelloWindow = 5 * time.Minute
)

// NewHello returns the hello payload by which rank proves to a peer that it belongs to job
// (it holds the job's secret, which the coordinator hands out with the roster).
func NewHello(secret []byte, job string, rank, size int, now time.Time) []byte {
	b := make([]byte, helloSize)
	binary.LittleEndian.PutUint16(b[0:], uint16(rank))
	binary.LittleEndian.PutUint16(b[2:], uint16(size))
	binary.LittleEndian.PutUint64(b[4:], uint64(now.UnixNano()))
	_, _ = rand.Read(b[12:28])
	copy(b[28:], helloMAC(secret, job, b[:28]))
	return b
}

// VerifyHello checks a hello payload for job with group size size and returns the sender's
// rank. It fails with ErrAuth on a wrong secret, job or group size, or a stale timestamp.
func VerifyHello(secret []byte, job string, size int, payload []byte, now time.Time) (int, error) {
	if len(payload) != helloSize {
		return 0, fmt.Errorf("%w: hello of %d bytes, want %d", ErrAuth, len(payload), helloSize)
	}
	if !hmac.Equal(payload[28:], helloMAC(secret, job, payload[:28])) {
		return 0, fmt.Errorf("%w: bad hello signature (wrong cluster key or job)", ErrAuth)
	}
	rank := int(binary.LittleEndian.Uint16(payload[0:]))
	if got := int(binary.LittleEndian.Uint16(payload[2:])); got != size || rank >= size {
		return 0, fmt.Errorf("%w: hello from rank %d of a group of %d, this group has %d", ErrAuth, rank, got, size)
	}
	sent := time.Unix(0, int64(binary.LittleEndian.Uint64(payload[4:])))
	if d := now.Sub(sent); d > HelloWindow || d < -HelloWindow {
		return 0, fmt.Errorf("%w: hello timestamp %v off by %v (clock skew or replay)", ErrAuth, sent.UTC(), d)
	}
	return rank, nil
}

func helloMAC(secret []byte, job string, msg []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("qvd-hello-v1"))
	m.Write([]byte(job))
	m.Write([]byte{0})
	m.Write(msg)
	return m.Sum(nil)
}
