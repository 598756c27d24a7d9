package cluster

import (
	"log"
	"regexp"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/qvd/qvd/internal/lograte"
)

// memberlist logs through a standard *log.Logger with lines like
//
//	[ERR] memberlist: failed to receive: no installed keys could decrypt the message from=10.0.0.7:41234
//
// mlLogWriter turns them into zap entries at the matching level, and recognises the few
// lines an operator must act on (a peer with the wrong cluster key) or that we already
// explain better ourselves (a rejected version).
//
// Anyone who can send a datagram to the gossip port can make memberlist log a line (a packet
// that does not decrypt, a message that does not decode), so every line at info level and
// above goes through one limiter: at most mlLogBurst lines at once and mlLogBurst per
// mlLogEvery, the next line after a gap saying how many were left out. A cluster at work
// logs a few memberlist lines a minute, far below the limit.
type mlLogWriter struct {
	log *zap.Logger
	lim *lograte.Limiter

	mu struct {
		sync.Mutex
		lastKeyWarn map[string]time.Time // remote address → last "wrong key" warning
	}
}

// keyWarnEvery limits "wrong key" warnings to one per remote address per interval: a
// misconfigured node retries its join, and one line per retry is noise.
const keyWarnEvery = 10 * time.Second

// The limit on memberlist's lines (see mlLogWriter).
const (
	mlLogBurst = 10
	mlLogEvery = 10 * time.Second
)

var fromRE = regexp.MustCompile(`from=(\S+)`)

func newMLLogger(l *zap.Logger) *log.Logger {
	w := &mlLogWriter{log: l.WithOptions(zap.AddCallerSkip(3)), lim: lograte.New(mlLogBurst, mlLogEvery)}
	w.mu.lastKeyWarn = make(map[string]time.Time)
	return log.New(w, "", 0)
}

func (w *mlLogWriter) Write(p []byte) (int, error) {
	line := strings.TrimRight(string(p), "\n")
	level, msg := zapcore.InfoLevel, line
	for _, l := range []struct {
		prefix string
		level  zapcore.Level
	}{
		{"[DEBUG]", zapcore.DebugLevel},
		{"[INFO]", zapcore.InfoLevel},
		{"[WARN]", zapcore.WarnLevel},
		{"[ERR]", zapcore.ErrorLevel},
		{"[ERROR]", zapcore.ErrorLevel},
	} {
		if strings.HasPrefix(line, l.prefix) {
			level, msg = l.level, strings.TrimSpace(line[len(l.prefix):])
			break
		}
	}
	msg = strings.TrimPrefix(msg, "memberlist: ")

	switch {
	case isKeyMismatch(msg):
		remote := remoteAddr(msg)
		if !w.shouldWarnKey(remote) {
			return len(p), nil
		}
		ok, suppressed := w.lim.Allow()
		if !ok {
			return len(p), nil
		}
		w.log.Warn("refused gossip that could not be decrypted: the sender does not use this cluster's key (check the cluster key on that node)",
			zap.String("remote_addr", remote), zap.String("memberlist", msg), lograte.Field(suppressed))
		return len(p), nil
	case strings.HasPrefix(msg, "Decrypt packet failed"):
		// Not this node's error: a datagram that is not gossip under any key (garbage, a
		// port scanner). Key mismatches were caught above.
		level = zapcore.WarnLevel
	case strings.Contains(msg, refusedMarker):
		// Our merge/alive delegates refused a node and already logged why, once.
		level = zapcore.DebugLevel
	case strings.Contains(msg, "use of closed network connection"):
		// A send racing this node's own shutdown: expected, not an error.
		level = zapcore.DebugLevel
	}
	// Most lines are debug chatter: check the level before doing any more work.
	ce := w.log.Check(level, "memberlist: "+msg)
	if ce == nil {
		return len(p), nil
	}
	var suppressed int
	if level >= zapcore.InfoLevel {
		var ok bool
		if ok, suppressed = w.lim.Allow(); !ok {
			return len(p), nil
		}
	}
	if remote := remoteAddr(msg); remote != "" {
		ce.Write(zap.String("remote_addr", remote), lograte.Field(suppressed))
	} else {
		ce.Write(lograte.Field(suppressed))
	}
	return len(p), nil
}

// remoteAddr extracts the peer address memberlist appends as "from=ip:port". For a TCP
// exchange that is the peer's ephemeral source port, not its gossip port; the IP is what
// identifies it.
func remoteAddr(msg string) string {
	if m := fromRE.FindStringSubmatch(msg); m != nil {
		return m[1]
	}
	return ""
}

func (w *mlLogWriter) shouldWarnKey(remote string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	now := time.Now()
	if t, ok := w.mu.lastKeyWarn[remote]; ok && now.Sub(t) < keyWarnEvery {
		return false
	}
	if len(w.mu.lastKeyWarn) > 1024 {
		clear(w.mu.lastKeyWarn) // bounded memory; at worst one extra warning per address
	}
	w.mu.lastKeyWarn[remote] = now
	return true
}

// isKeyMismatch recognises memberlist's messages for traffic encrypted with another key
// (or not encrypted at all, by a node without a key).
func isKeyMismatch(msg string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "no installed keys could decrypt") ||
		strings.Contains(m, "encryption is configured but remote state is not encrypted") ||
		strings.Contains(m, "remote state is encrypted and encryption is not configured")
}
