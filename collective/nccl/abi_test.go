//go:build !cuda

// Not in the cuda build: the fake library below exports NCCL's symbols into the process
// (dynlib opens with RTLD_GLOBAL), which must never happen beside the real libnccl.

package nccl

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/dynlib"
)

// fakeNCCL has NCCL's signatures and checks every argument it is passed, so that the purego
// bindings are tested without a GPU: above all that ncclCommInitRankConfig receives the
// 128-byte ncclUniqueId by value intact (x86-64 passes it on the stack, arm64 by reference),
// with the rank and the config that follow it in their registers.
const fakeNCCL = `
#include <limits.h>
#include <stddef.h>
#include <stdint.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct {
	size_t size;
	unsigned int magic;
	unsigned int version;
	int blocking;
	int cgaClusterSize;
} ncclConfig_t;

static unsigned char idByte(int i) { return (unsigned char)(i * 7 + 3); }
static void *const theComm = (void *)0x1234;
static void *const theStream = (void *)0x5678;

int ncclGetVersion(int *v) { *v = VERSION; return 0; }

int ncclGetUniqueId(ncclUniqueId *id) {
	for (int i = 0; i < 128; i++) id->internal[i] = (char)idByte(i);
	return 0;
}

int ncclCommInitRankConfig(void **comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t *cfg) {
	for (int i = 0; i < 128; i++)
		if ((unsigned char)id.internal[i] != idByte(i)) return 100 + i;
	if (nranks != 3) return 1;
	if (rank != 2) return 2;
	if (cfg->size != 24 || cfg->magic != 0xcafebeef || cfg->version != 21400) return 3;
	if (cfg->blocking != 0 || cfg->cgaClusterSize != INT_MIN) return 4;
	*comm = theComm;
	return 7; /* ncclInProgress */
}

static int polls;
int ncclCommGetAsyncError(void *comm, int *state) {
	if (comm != theComm) return 4;
	*state = ++polls < 3 ? 7 : 0;
	return 0;
}

#ifndef MISSING
int ncclCommFinalize(void *comm) { return comm == theComm ? 7 : 4; }
#endif
int ncclCommDestroy(void *comm) { return comm == theComm ? 0 : 4; }
int ncclCommAbort(void *comm) { return comm == theComm ? 0 : 4; }

const char *ncclGetErrorString(int r) { return r == 4 ? "invalid argument" : "unhandled result"; }
const char *ncclGetLastError(void *comm) { return comm == theComm ? "the fake's last error" : ""; }

static int args(const void *s, void *r, const void *wantS, const void *wantR, void *comm, void *stream) {
	return s == wantS && r == wantR && comm == theComm && stream == theStream;
}

int ncclAllReduce(const void *s, void *r, size_t count, int dt, int op, void *comm, void *stream) {
	return args(s, r, (void *)0x1000, (void *)0x1000, comm, stream) && count == ((size_t)1 << 33) + 5 &&
		dt == 9 && op == 2 ? 0 : 4;
}
int ncclReduceScatter(const void *s, void *r, size_t count, int dt, int op, void *comm, void *stream) {
	return args(s, r, (void *)0x1000, (void *)0x2000, comm, stream) && count == 77 && dt == 6 && op == 0 ? 0 : 4;
}
int ncclAllGather(const void *s, void *r, size_t count, int dt, void *comm, void *stream) {
	return args(s, r, (void *)0x2000, (void *)0x1000, comm, stream) && count == 78 && dt == 7 ? 0 : 4;
}
int ncclBroadcast(const void *s, void *r, size_t count, int dt, int root, void *comm, void *stream) {
	return args(s, r, (void *)0x3000, (void *)0x3000, comm, stream) && count == 79 && dt == 5 && root == 2 ? 0 : 4;
}
`

// buildFake compiles fakeNCCL into a shared library, skipping the test without a C compiler.
func buildFake(t *testing.T, name string, defines ...string) string {
	t.Helper()
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler (%s) to build a fake NCCL: %v", cc, err)
	}
	dir := t.TempDir()
	src := filepath.Join(dir, "fake_nccl.c")
	if err := os.WriteFile(src, []byte(fakeNCCL), 0o644); err != nil {
		t.Fatal(err)
	}
	lib := filepath.Join(dir, name)
	args := append([]string{"-shared", "-fPIC", "-O1", "-o", lib, src}, defines...)
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		t.Fatalf("%s %s: %v\n%s", cc, strings.Join(args, " "), err, out)
	}
	return lib
}

func fakeSpec(path string) dynlib.Spec {
	return dynlib.Spec{What: "NCCL", Env: "QVD_TEST_FAKE_NCCL_UNSET", Names: []string{path}}
}

func TestBindingsAgainstAFakeNCCL(t *testing.T) {
	l, err := openLibrary(fakeSpec(buildFake(t, "libfakenccl.so", "-DVERSION=22105")))
	if err != nil {
		t.Fatal(err)
	}
	if l.version != 22105 || !strings.HasPrefix(l.String(), "2.21.5 (") {
		t.Fatalf("version %d, %s", l.version, l)
	}
	var id uniqueID
	if r := l.getUniqueID(&id); r != ncclSuccess {
		t.Fatalf("ncclGetUniqueId: %d", r)
	}
	for i, b := range id.Internal {
		if b != byte(i*7+3) {
			t.Fatalf("id byte %d = %#x", i, b)
		}
	}
	// The id by value, between two register arguments and before two more.
	cfg := nonBlocking()
	var comm uintptr
	if r := l.commInitRankConfig(&comm, 3, id, 2, &cfg); r != ncclInProgress || comm != 0x1234 {
		t.Fatalf("ncclCommInitRankConfig = %d (fake's code: 1xx = id byte xx wrong, 1 nranks, 2 rank, 3-4 config), comm %#x", r, comm)
	}
	var st int32
	for range 2 {
		if r := l.commGetAsyncError(comm, &st); r != ncclSuccess || st != ncclInProgress {
			t.Fatalf("ncclCommGetAsyncError = %d, state %d", r, st)
		}
	}
	if r := l.commGetAsyncError(comm, &st); r != ncclSuccess || st != ncclSuccess {
		t.Fatalf("ncclCommGetAsyncError = %d, state %d", r, st)
	}
	const stream = 0x5678
	for name, r := range map[string]int32{
		"ncclAllReduce":     l.allReduce(0x1000, 0x1000, 1<<33+5, ncclBfloat16, ncclMax, comm, stream),
		"ncclReduceScatter": l.reduceScatter(0x1000, 0x2000, 77, ncclFloat16, ncclSum, comm, stream),
		"ncclAllGather":     l.allGather(0x2000, 0x1000, 78, ncclFloat32, comm, stream),
		"ncclBroadcast":     l.broadcast(0x3000, 0x3000, 79, ncclUint64, 2, comm, stream),
		"ncclCommFinalize":  l.commFinalize(comm) - ncclInProgress,
		"ncclCommDestroy":   l.commDestroy(comm),
		"ncclCommAbort":     l.commAbort(comm),
	} {
		if r != ncclSuccess {
			t.Errorf("%s: the fake saw wrong arguments (%d)", name, r)
		}
	}
	err = l.resultErr("ncclAllReduce", ncclInvalidArgument, comm)
	if want := "ncclAllReduce: ncclInvalidArgument (invalid argument: the fake's last error)"; err.Error() != want {
		t.Errorf("error %q, want %q", err, want)
	}
}

func TestOldNCCLIsRefusedByVersion(t *testing.T) {
	_, err := openLibrary(fakeSpec(buildFake(t, "libfakenccl-old.so", "-DVERSION=21003")))
	if err == nil || !strings.Contains(err.Error(), "NCCL 2.10.3") || !strings.Contains(err.Error(), "2.14.0 or newer") {
		t.Fatalf("err = %v", err)
	}
}

func TestMissingSymbolIsNamed(t *testing.T) {
	_, err := openLibrary(fakeSpec(buildFake(t, "libfakenccl-missing.so", "-DVERSION=21800", "-DMISSING")))
	if err == nil || !strings.Contains(err.Error(), "ncclCommFinalize") || !strings.Contains(err.Error(), "2.18.0") {
		t.Fatalf("err = %v", err)
	}
}
