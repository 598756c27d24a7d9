package nccl

import (
	"errors"
	"strings"
	"testing"

	"github.com/qvd/qvd/internal/dynlib"
)

// A machine without NCCL (or with QVD_NCCL_LIBRARY pointing nowhere) gets an error that says
// what is missing and how to point qvd at it, not a loader failure.
func TestMissingLibraryNamesNCCLAndTheVariable(t *testing.T) {
	t.Setenv("QVD_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
	_, err := openLibrary(ncclSpec)
	if !errors.Is(err, dynlib.ErrNotFound) {
		t.Fatalf("err = %v, want dynlib.ErrNotFound", err)
	}
	for _, want := range []string{"NCCL", "QVD_NCCL_LIBRARY", "/nonexistent/libnccl.so.2"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
}

func TestVersionString(t *testing.T) {
	for code, want := range map[int]string{2708: "2.7.8", 21400: "2.14.0", 22105: "2.21.5", 22703: "2.27.3", 30001: "3.0.1"} {
		if got := versionString(code); got != want {
			t.Errorf("versionString(%d) = %q, want %q", code, got, want)
		}
	}
}

func TestResultErrorMapsPeerFailures(t *testing.T) {
	e := &resultError{call: "ncclAllReduce", result: ncclRemoteError, detail: "remote process exited"}
	if !errors.Is(e, errPeer) || !strings.Contains(e.Error(), "ncclRemoteError (remote process exited)") {
		t.Fatalf("%v", e)
	}
	if e := (&resultError{call: "x", result: ncclInvalidUsage}); errors.Unwrap(e) != nil {
		t.Fatalf("an invalid usage is nobody else's fault: %v", errors.Unwrap(e))
	}
}
