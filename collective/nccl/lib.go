package nccl

// Loading and binding libnccl with purego. This file is in every build so that the test of a
// missing library runs on any machine; nothing here touches a GPU.

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/internal/dynlib"
)

// ncclSpec is where NCCL is looked for: $QVD_NCCL_LIBRARY, libnccl.so.2 through the dynamic
// loader, then the pip wheels' copies (nvidia-nccl-cu12 and -cu13, as PyTorch installs them).
var ncclSpec = dynlib.Spec{
	What:  "NCCL",
	Env:   "QVD_NCCL_LIBRARY",
	Names: []string{"libnccl.so.2"},
	Globs: dynlib.PipGlobs("libnccl.so.*"),
}

// minVersion is the oldest NCCL that has non-blocking communicators (ncclCommInitRankConfig
// with blocking = 0), ncclCommFinalize, ncclGetLastError, ncclAvg and bfloat16.
const minVersion = 21400

// ncclResult_t.
const (
	ncclSuccess            = 0
	ncclUnhandledCudaError = 1
	ncclSystemError        = 2
	ncclInternalError      = 3
	ncclInvalidArgument    = 4
	ncclInvalidUsage       = 5
	ncclRemoteError        = 6
	ncclInProgress         = 7
	ncclTimeout            = 8
)

// ncclDataType_t (nccl.h).
const (
	ncclUint8    = 1
	ncclInt64    = 4
	ncclUint64   = 5
	ncclFloat16  = 6
	ncclFloat32  = 7
	ncclBfloat16 = 9
)

// ncclRedOp_t (nccl.h): ncclProd is 1.
const (
	ncclSum = 0
	ncclMax = 2
	ncclMin = 3
	ncclAvg = 4
)

// uniqueIDBytes is NCCL_UNIQUE_ID_BYTES.
const uniqueIDBytes = 128

// uniqueID is ncclUniqueId, { char internal[128]; }, passed by value to
// ncclCommInitRankConfig. It must be a struct (purego passes arrays only inside structs).
type uniqueID struct {
	Internal [uniqueIDBytes]byte
}

// commConfig is the head of ncclConfig_t as NCCL 2.14 defined it. NCCL copies
// min(size, sizeof(its ncclConfig_t)) bytes over its defaults and ignores the fields a config
// of an older version does not have, so this prefix works with every later NCCL.
type commConfig struct {
	Size           uintptr // sizeof the struct passed
	Magic          uint32  // NCCL_API_MAGIC
	Version        uint32  // NCCL_VERSION(2,14,0): the layout this struct follows
	Blocking       int32   // 0: every call may return ncclInProgress instead of blocking
	CgaClusterSize int32   // NCCL_CONFIG_UNDEF_INT (a 2.17 field; ignored for version 2.14)
}

const (
	ncclAPIMagic       = 0xcafebeef
	ncclConfigUndefInt = -1 << 31 // INT_MIN
)

// nonBlocking is the configuration of every communicator qvd makes.
func nonBlocking() commConfig {
	c := commConfig{Magic: ncclAPIMagic, Version: minVersion, Blocking: 0, CgaClusterSize: ncclConfigUndefInt}
	c.Size = unsafe.Sizeof(c)
	return c
}

// library is libnccl with the functions qvd calls. Every function returns ncclResult_t.
type library struct {
	path    string
	version int // NCCL_VERSION_CODE of the loaded library

	getVersion         func(version *int32) int32
	getUniqueID        func(id *uniqueID) int32
	commInitRankConfig func(comm *uintptr, nranks int32, id uniqueID, rank int32, cfg *commConfig) int32
	commFinalize       func(comm uintptr) int32
	commDestroy        func(comm uintptr) int32
	commAbort          func(comm uintptr) int32
	commGetAsyncError  func(comm uintptr, state *int32) int32
	getErrorString     func(result int32) string
	getLastError       func(comm uintptr) string
	allReduce          func(send, recv, count uintptr, dtype, op int32, comm, stream uintptr) int32
	reduceScatter      func(send, recv, recvCount uintptr, dtype, op int32, comm, stream uintptr) int32
	allGather          func(send, recv, sendCount uintptr, dtype int32, comm, stream uintptr) int32
	broadcast          func(send, recv, count uintptr, dtype, root int32, comm, stream uintptr) int32
}

var loaded struct {
	sync.Mutex
	lib *library
}

// loadLibrary returns libnccl, loading it on first use. A success is kept for the life of
// the process: NCCL's threads must never see their library unloaded.
func loadLibrary() (*library, error) {
	loaded.Lock()
	defer loaded.Unlock()
	if loaded.lib != nil {
		return loaded.lib, nil
	}
	lib, err := openLibrary(ncclSpec)
	if err != nil {
		return nil, err
	}
	loaded.lib = lib
	return lib, nil
}

// openLibrary loads and binds the library that spec finds, and checks its version.
func openLibrary(spec dynlib.Spec) (*library, error) {
	dl, err := dynlib.Open(spec)
	if err != nil {
		return nil, fmt.Errorf("nccl: %w", err)
	}
	l := &library{path: dl.Path}
	binds := []struct {
		fptr any
		name string
	}{
		{&l.getVersion, "ncclGetVersion"},
		{&l.getUniqueID, "ncclGetUniqueId"},
		{&l.commInitRankConfig, "ncclCommInitRankConfig"},
		{&l.commFinalize, "ncclCommFinalize"},
		{&l.commDestroy, "ncclCommDestroy"},
		{&l.commAbort, "ncclCommAbort"},
		{&l.commGetAsyncError, "ncclCommGetAsyncError"},
		{&l.getErrorString, "ncclGetErrorString"},
		{&l.getLastError, "ncclGetLastError"},
		{&l.allReduce, "ncclAllReduce"},
		{&l.reduceScatter, "ncclReduceScatter"},
		{&l.allGather, "ncclAllGather"},
		{&l.broadcast, "ncclBroadcast"},
	}
	// The version first: a missing symbol of an old NCCL is better explained by its version.
	if err := dl.Bind(binds[0].fptr, binds[0].name); err != nil {
		return nil, fmt.Errorf("nccl: %s is not NCCL: %w", dl.Path, err)
	}
	var v int32
	if r := l.getVersion(&v); r != ncclSuccess {
		return nil, fmt.Errorf("nccl: ncclGetVersion of %s failed: result %d", dl.Path, r)
	}
	l.version = int(v)
	if l.version < minVersion {
		return nil, fmt.Errorf("nccl: %s is NCCL %s; qvd needs NCCL %s or newer (non-blocking communicators); set %s to a newer libnccl.so.2",
			dl.Path, versionString(l.version), versionString(minVersion), spec.Env)
	}
	for _, b := range binds[1:] {
		if err := dl.Bind(b.fptr, b.name); err != nil {
			return nil, fmt.Errorf("nccl: NCCL %s: %w", versionString(l.version), err)
		}
	}
	return l, nil
}

// versionString decodes NCCL_VERSION_CODE: X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z since.
func versionString(code int) string {
	if code < 10000 {
		return fmt.Sprintf("%d.%d.%d", code/1000, code%1000/100, code%100)
	}
	return fmt.Sprintf("%d.%d.%d", code/10000, code%10000/100, code%100)
}

// String is "2.21.5 (/path/libnccl.so.2)".
func (l *library) String() string { return versionString(l.version) + " (" + l.path + ")" }

// resultName names an ncclResult_t for errors when the library cannot.
func resultName(r int32) string {
	switch r {
	case ncclSuccess:
		return "ncclSuccess"
	case ncclUnhandledCudaError:
		return "ncclUnhandledCudaError"
	case ncclSystemError:
		return "ncclSystemError"
	case ncclInternalError:
		return "ncclInternalError"
	case ncclInvalidArgument:
		return "ncclInvalidArgument"
	case ncclInvalidUsage:
		return "ncclInvalidUsage"
	case ncclRemoteError:
		return "ncclRemoteError"
	case ncclInProgress:
		return "ncclInProgress"
	case ncclTimeout:
		return "ncclTimeout"
	}
	return fmt.Sprintf("ncclResult %d", r)
}

// resultError is a failed NCCL call: the call, its ncclResult_t and NCCL's explanation.
type resultError struct {
	call   string
	result int32
	detail string // ncclGetErrorString, and ncclGetLastError when it says more
}

func (e *resultError) Error() string {
	s := fmt.Sprintf("%s: %s", e.call, resultName(e.result))
	if e.detail != "" {
		s += " (" + e.detail + ")"
	}
	return s
}

// Unwrap maps a remote failure and NCCL's own timeout to the collective package's errors.
func (e *resultError) Unwrap() error {
	switch e.result {
	case ncclRemoteError, ncclSystemError:
		return errPeer
	case ncclTimeout:
		return errTimeout
	}
	return nil
}

var (
	errPeer    = fmt.Errorf("a peer failed or its connection broke: %w", collective.ErrPeerGone)
	errTimeout = fmt.Errorf("NCCL timed out: %w", collective.ErrTimeout)
)

// resultErr describes result r of call, with NCCL's words for it (comm may be 0).
func (l *library) resultErr(call string, r int32, comm uintptr) error {
	detail := l.getErrorString(r)
	if last := l.getLastError(comm); last != "" && last != detail {
		if detail != "" {
			detail += ": "
		}
		detail += last
	}
	return &resultError{call: call, result: r, detail: detail}
}
