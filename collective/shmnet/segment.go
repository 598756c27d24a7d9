//go:build linux

package shmnet

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"unsafe"

	"go.uber.org/zap"
	"golang.org/x/sys/unix"

	"github.com/qvd/qvd/collective"
)

// Segment layout. Every offset is a multiple of 64 (a cache line) and every page-sized part
// starts on a page, so the atomics below are aligned and a mapping can never split a word.
//
//	header page (pageSize):
//	  0    magic      uint64   segMagic, stored last: the header is complete
//	  8    version    uint32
//	  12   size       uint32   ranks in the group
//	  16   rank       uint32   the creator's (receiver's) rank
//	  24   ringBytes  uint64
//	  32   pid        int64    the creator's pid (for messages only)
//	  40   nonce      [16]byte
//	  56   arenaBytes uint64   size of the shared arena at the segment's end
//	  64   token      [32]byte HMAC-SHA256(secret, "qvd-shm-segment-v1" | job | 0 | bytes 8..64)
//	  128  closed     uint32   the creator closed its transport (own cache line)
//	  192  posted     7×uint64 the creator's collective.Posted: step, tag, off, n, call, shards,
//	                           fault (own cache line; step stored last)
//	  256  postSeq    uint32   futex word peers awaiting the record sleep on; the creator bumps it
//	  260  postWait   uint32   how many peers sleep (or are about to) on postSeq
//	slot s (one per sending rank s; the creator's own is never used), at
//	pageSize + s*(pageSize+ringBytes):
//	  0    head       uint64   bytes the sender has published (own cache line)
//	  64   tail       uint64   bytes the receiver has consumed (own cache line)
//	  128  dataSeq    uint32   futex word the receiver sleeps on; the sender bumps it to wake
//	  132  dataWait   uint32   1 while the receiver sleeps (or is about to)
//	  136  dataWant   uint64   the head the sleeping receiver waits for
//	  192  spaceSeq   uint32   futex word the sender sleeps on; the receiver bumps it
//	  196  spaceWait  uint32
//	  200  spaceWant  uint64   the tail the sleeping sender waits for
//	  256  attached   uint32   1 once the sender has attached (stored last)
//	  260  prodState  uint32   prodOpen, prodClosed (sender closed), prodCut (abandoned a frame)
//	  264  prodPid    int64    the sender's pid (for messages only)
//	  272  proof      [32]byte HMAC-SHA256(secret, "qvd-shm-attach-v2" | job | 0 | rank, s, pid, nonce, prodNonce)
//	  304  prodNonce  [16]byte the nonce of the sender's own segment: names the process that attached
//	  pageSize: the ring, ringBytes bytes
//	arena, at arenaOffset(size, ringBytes): arenaBytes bytes, sparse until allocated (shared.go)
const (
	pageSize = 4096
	segMagic = 0x3130_4d48_5344_5651 // "QVDSHM01" in little-endian bytes
	// segVer 2: liveness by flock instead of pids, and the attach record names the
	// sender's own segment (prodNonce) instead of trusting its pid. 3: the shared arena and
	// the progress record of the direct path.
	segVer = 3

	hdrMagic, hdrVersion, hdrSize, hdrRank = 0, 8, 12, 16
	hdrRingBytes, hdrPid, hdrNonce         = 24, 32, 40
	hdrArenaBytes, hdrToken, hdrClosed     = 56, 64, 128
	hdrSigned                              = hdrToken // bytes [8, hdrToken) are signed
	hdrPosted, hdrPostSeq, hdrPostWait     = 192, 256, 260

	slotHead, slotTail                           = 0, 64
	slotDataSeq, slotDataWait, slotDataWant      = 128, 132, 136
	slotSpaceSeq, slotSpaceWait, slotSpaceWant   = 192, 196, 200
	slotAttached, slotProdState, slotPid, slotPf = 256, 260, 264, 272
	slotNonce                                    = 304

	macSize = sha256.Size

	prodOpen   = 0
	prodClosed = 1
	prodCut    = 2
)

// segBytes is the size of a segment for a group of size with rings of ringBytes and an
// arena of arenaBytes.
func segBytes(size, ringBytes int, arenaBytes int64) int64 {
	return arenaOffset(size, ringBytes) + arenaBytes
}

// arenaOffset is where the arena starts: after the header and the slots (page-aligned).
func arenaOffset(size, ringBytes int) int64 {
	return pageSize + int64(size)*(pageSize+int64(ringBytes))
}

func slotOffset(s, ringBytes int) int64 {
	return pageSize + int64(s)*(pageSize+int64(ringBytes))
}

// segName is a segment's file name: qvd-<job>-<rank>-<pid>. The pid tells a person which
// process made it (liveness is judged by the file's lock, never by the pid, which may be
// another pid namespace's); the job may contain '-', so names are parsed from the right.
func segName(job string, rank, pid int) string {
	return "qvd-" + job + "-" + strconv.Itoa(rank) + "-" + strconv.Itoa(pid)
}

// namePid returns the pid of a qvd-* segment name, or false: the sweep only considers
// names of this form.
func namePid(name string) (int, bool) {
	if !strings.HasPrefix(name, "qvd-") {
		return 0, false
	}
	i := strings.LastIndexByte(name, '-')
	pid, err := strconv.Atoi(name[i+1:])
	if err != nil || pid <= 0 || !allDigits(name[i+1:]) {
		return 0, false
	}
	return pid, true
}

func allDigits(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return false
		}
	}
	return true
}

// segment is a mapped segment file: this rank's own (it receives in it) or a peer's (this
// rank sends in its slot there).
type segment struct {
	path      string
	mem       []byte // this rank's own: the header and slots; a peer's: all of it, arena included
	rank      int    // the creator's rank
	size      int
	ringBytes int
	arena     int64 // arenaBytes
	pid       int
	nonce     [16]byte
	// fd stays open for the transport's life: on this rank's own segment it holds the
	// creator's flock (see lock.go); on a peer's it is what ownerGone probes, opened while the
	// file still had a name, and what the first Send reserves the slot's memory through. -1
	// once closed.
	fd int
	// reserved: this rank's slot in the peer's segment has been allocated (fallocate), so
	// that a full tmpfs is an error rather than a SIGBUS.
	reserved bool
}

func (s *segment) u32(off int64) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&s.mem[off]))
}

func (s *segment) u64(off int64) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&s.mem[off]))
}

func (s *segment) closedWord() *atomic.Uint32 { return s.u32(hdrClosed) }

// slot returns the control words and ring of sender s's slot.
func (s *segment) slot(sender int) *ring {
	off := slotOffset(sender, s.ringBytes)
	return &ring{
		head: s.u64(off + slotHead), tail: s.u64(off + slotTail),
		data: waitWord{seq: s.u32(off + slotDataSeq), waiting: s.u32(off + slotDataWait), want: s.u64(off + slotDataWant)},
		space: waitWord{seq: s.u32(off + slotSpaceSeq), waiting: s.u32(off + slotSpaceWait),
			want: s.u64(off + slotSpaceWant)},
		attached:  s.u32(off + slotAttached),
		prodState: s.u32(off + slotProdState),
		ctl:       s.mem[off : off+pageSize],
		buf:       s.mem[off+pageSize : off+pageSize+int64(s.ringBytes)],
		mask:      uint64(s.ringBytes - 1),
	}
}

// unmap releases the mapping and the descriptor, if still held.
func (s *segment) unmap() {
	if s.fd >= 0 {
		_ = unix.Close(s.fd)
		s.fd = -1
	}
	if s.mem != nil {
		_ = unix.Munmap(s.mem)
		s.mem = nil
	}
}

// reserve allocates the pages of sender's slot, once, so that touching them cannot fault.
func (s *segment) reserve(sender int) error {
	if s.reserved || s.fd < 0 {
		return nil
	}
	err := unix.Fallocate(s.fd, 0, slotOffset(sender, s.ringBytes), pageSize+int64(s.ringBytes))
	s.reserved = true
	if err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		return fmt.Errorf("shmnet: reserving %d bytes in %s for the ring from rank %d: %w (is the shared-memory "+
			"filesystem too small? docker: --shm-size)", pageSize+s.ringBytes, s.path, sender, err)
	}
	return nil
}

// token is the creator's proof of the secret, over the signed header bytes.
func token(secret []byte, job string, signed []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("qvd-shm-segment-v1"))
	m.Write([]byte(job))
	m.Write([]byte{0})
	m.Write(signed)
	return m.Sum(nil)
}

// proof is an attaching sender's proof of the secret, bound to the segment's nonce so it
// cannot be replayed into another segment, and to the nonce of the sender's own segment, so
// the creator can check that the process that attached is the one that made the sender's
// segment (pids cannot say so across pid namespaces).
func proof(secret []byte, job string, rank, sender, pid int, nonce, senderNonce []byte) []byte {
	m := hmac.New(sha256.New, secret)
	m.Write([]byte("qvd-shm-attach-v2"))
	m.Write([]byte(job))
	m.Write([]byte{0})
	var b [16]byte
	binary.LittleEndian.PutUint32(b[0:], uint32(rank))
	binary.LittleEndian.PutUint32(b[4:], uint32(sender))
	binary.LittleEndian.PutUint64(b[8:], uint64(pid))
	m.Write(b[:])
	m.Write(nonce)
	m.Write(senderNonce)
	return m.Sum(nil)
}

// createAttempts bounds createSegment's retries when a sweep removes the new name in the
// instant between its creation and the creator's lock (each retry needs another sweep to
// strike in that instant, so a second attempt all but always succeeds).
const createAttempts = 5

// createSegment makes this rank's segment: created exclusively (never through a symlink),
// mode 0600 whatever the umask, locked (flock LOCK_EX, held through the returned segment's
// fd until unmap: the liveness peers and sweeps test), sized, mapped, and its header
// written and signed, the magic last.
func createSegment(dir, job string, rank, size, ringBytes int, arena int64, pid int, secret []byte) (*segment, error) {
	path := filepath.Join(dir, segName(job, rank, pid))
	for range createAttempts {
		fd, err := unix.Open(path, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("shmnet: creating segment %s: %w", path, err)
		}
		if err := lockOwner(fd); err != nil {
			_ = unix.Unlink(path)
			_ = unix.Close(fd)
			return nil, fmt.Errorf("shmnet: locking segment %s: %w", path, err)
		}
		// A sweep in another process may have taken the lock of the file just created,
		// before this one did, and removed its name: then make it again.
		same, err := sameFile(fd, path)
		if err != nil {
			_ = unix.Close(fd)
			return nil, fmt.Errorf("shmnet: checking segment %s: %w", path, err)
		}
		if !same {
			_ = unix.Close(fd)
			continue
		}
		return initSegment(fd, path, rank, size, ringBytes, arena, pid, job, secret)
	}
	return nil, fmt.Errorf("shmnet: creating segment %s: removed by another process's sweep %d times in a row", path, createAttempts)
}

// initSegment sizes, maps and signs a segment just created and locked at fd; on failure it
// unlinks path and closes fd.
func initSegment(fd int, path string, rank, size, ringBytes int, arena int64, pid int, job string, secret []byte) (*segment, error) {
	fail := func(what string, err error) (*segment, error) {
		_ = unix.Unlink(path)
		_ = unix.Close(fd)
		return nil, fmt.Errorf("shmnet: %s segment %s: %w", what, path, err)
	}
	if err := unix.Fchmod(fd, 0o600); err != nil {
		return fail("chmod", err)
	}
	// The arena is a hole until buffers are allocated in it (shared.go), and mapped apart
	// from the rest (transport.mapArena), so that its buffers can outlive Close.
	if err := unix.Ftruncate(fd, segBytes(size, ringBytes, arena)); err != nil {
		return fail("sizing", err)
	}
	// The header page is written now; reserve it so a full tmpfs fails here, not by SIGBUS.
	if err := unix.Fallocate(fd, 0, 0, pageSize); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		return fail("reserving the header of", err)
	}
	mem, err := unix.Mmap(fd, 0, int(arenaOffset(size, ringBytes)), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("mapping", err)
	}
	s := &segment{path: path, mem: mem, rank: rank, size: size, ringBytes: ringBytes, arena: arena, pid: pid, fd: fd, reserved: true}
	if _, err := rand.Read(s.nonce[:]); err != nil {
		_ = unix.Munmap(mem)
		return fail("making a nonce for", err)
	}
	binary.LittleEndian.PutUint32(mem[hdrVersion:], segVer)
	binary.LittleEndian.PutUint32(mem[hdrSize:], uint32(size))
	binary.LittleEndian.PutUint32(mem[hdrRank:], uint32(rank))
	binary.LittleEndian.PutUint64(mem[hdrRingBytes:], uint64(ringBytes))
	binary.LittleEndian.PutUint64(mem[hdrPid:], uint64(pid))
	copy(mem[hdrNonce:], s.nonce[:])
	binary.LittleEndian.PutUint64(mem[hdrArenaBytes:], uint64(arena))
	copy(mem[hdrToken:], token(secret, job, mem[hdrVersion:hdrSigned]))
	s.u64(hdrMagic).Store(segMagic)
	return s, nil
}

// errNotReady: the segment exists but its creator has not finished writing it, or no live
// process holds it (a dead creator's leftover, which the next sweep removes); look again.
var errNotReady = errors.New("segment not ready")

// openSegment maps peer rank's segment at path after checking that nobody but this user can
// have made or changed it (owner, mode, regular file) and that its creator holds the job's
// secret (the token). Errors wrap collective.ErrAuth where the file fails a check, and name
// the file and the reason; errNotReady where the creator is still writing it or is gone. The
// returned segment keeps its descriptor open: ownerGone probes it for the creator's lock.
func openSegment(path, job string, rank, size, pid int, secret []byte) (*segment, error) {
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, errNotReady // unlinked between listing and opening: look again
		}
		return nil, fmt.Errorf("shmnet: opening rank %d's segment %s: %w", rank, path, err)
	}
	keep := false
	defer func() {
		if !keep {
			_ = unix.Close(fd)
		}
	}()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("shmnet: stat of rank %d's segment %s: %w", rank, path, err)
	}
	authErr := func(format string, a ...any) error {
		return fmt.Errorf("shmnet: refusing rank %d's segment %s: %s: %w", rank, path, fmt.Sprintf(format, a...), collective.ErrAuth)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, authErr("not a regular file")
	case int(st.Uid) != os.Geteuid():
		return nil, authErr("owned by uid %d, not by this process's uid %d", st.Uid, os.Geteuid())
	case st.Mode&0o7777 != 0o600:
		return nil, authErr("mode %#o, want 0600 (readable or writable by others)", st.Mode&0o7777)
	case st.Size < pageSize:
		return nil, errNotReady // created, not yet sized
	}
	// The creator locks its file before writing anything: a complete header without the lock
	// is a dead process's leftover, however alive its pid looks from here.
	if gone, err := ownerGone(fd); err != nil {
		return nil, fmt.Errorf("shmnet: probing rank %d's segment %s: %w", rank, path, err)
	} else if gone {
		return nil, errNotReady
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("shmnet: mapping rank %d's segment %s: %w", rank, path, err)
	}
	s := &segment{path: path, mem: mem, fd: -1}
	ok := false
	defer func() {
		if !ok {
			s.unmap()
		}
	}()
	if s.u64(hdrMagic).Load() != segMagic {
		return nil, errNotReady
	}
	ver := binary.LittleEndian.Uint32(mem[hdrVersion:])
	s.size = int(binary.LittleEndian.Uint32(mem[hdrSize:]))
	s.rank = int(binary.LittleEndian.Uint32(mem[hdrRank:]))
	rb := binary.LittleEndian.Uint64(mem[hdrRingBytes:])
	s.pid = int(int64(binary.LittleEndian.Uint64(mem[hdrPid:])))
	copy(s.nonce[:], mem[hdrNonce:])
	arena := binary.LittleEndian.Uint64(mem[hdrArenaBytes:])
	switch {
	case !hmac.Equal(mem[hdrToken:hdrToken+macSize], token(secret, job, mem[hdrVersion:hdrSigned])):
		return nil, authErr("its token does not verify (made with another secret or for another job)")
	case ver != segVer:
		return nil, fmt.Errorf("shmnet: rank %d's segment %s has layout version %d, this qvd uses %d", rank, path, ver, segVer)
	case s.rank != rank || s.size != size || s.pid != pid:
		return nil, authErr("it says rank %d of %d, pid %d; want rank %d of %d, pid %d (from its name)",
			s.rank, s.size, s.pid, rank, size, pid)
	case rb < minRing || rb > maxRing || rb&(rb-1) != 0:
		return nil, fmt.Errorf("shmnet: rank %d's segment %s has rings of %d bytes", rank, path, rb)
	case arena > maxArena || arena%pageSize != 0:
		return nil, fmt.Errorf("shmnet: rank %d's segment %s has an arena of %d bytes", rank, path, arena)
	case st.Size != segBytes(size, int(rb), int64(arena)):
		return nil, fmt.Errorf("shmnet: rank %d's segment %s is %d bytes, its header implies %d", rank, path, st.Size, segBytes(size, int(rb), int64(arena)))
	}
	s.ringBytes, s.arena = int(rb), int64(arena)
	s.fd, keep, ok = fd, true, true
	return s, nil
}

// sweep removes segment files in dir that this user's processes created and that outlived
// them (a process killed between creating its segment and unlinking it, which is the only
// window in which a segment has a name). A file is stale when its lock can be taken: no
// process holds it (see lock.go), whichever pid namespace made it. Files of other users,
// files a live process holds and names not of the qvd-<job>-<rank>-<pid> form are left
// alone. It returns the first error reading dir.
func sweep(dir string, log *zap.Logger) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return fmt.Errorf("shmnet: listing %s: %w", dir, err)
	}
	for _, e := range ents {
		pid, ok := namePid(e.Name())
		if !ok || !e.Type().IsRegular() {
			continue
		}
		path := filepath.Join(dir, e.Name())
		if sweepOne(path) {
			log.Info("removed a stale shared-memory segment", zap.String("path", path), zap.Int("pid", pid))
		}
	}
	return nil
}

// sweepOne removes path if it is this user's and no process holds its lock; it reports
// whether it did.
func sweepOne(path string) bool {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return false
	}
	defer func() { _ = unix.Close(fd) }() // releases the lock, after the unlink
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || int(st.Uid) != os.Geteuid() {
		return false
	}
	if stale, err := tryLockStale(fd); err != nil || !stale {
		return false
	}
	// Holding the lock, make sure the name still means this file before removing it.
	if same, err := sameFile(fd, path); err != nil || !same {
		return false
	}
	return unix.Unlink(path) == nil
}
