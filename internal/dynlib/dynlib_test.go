package dynlib

import (
	"errors"
	"strings"
	"testing"
)

func TestOpenMissingNamesEveryAttemptAndTheVariable(t *testing.T) {
	_, err := Open(Spec{What: "cuBLAS", Env: "QVD_TEST_NO_SUCH_LIB", Names: []string{"libqvd-no-such.so.1"}})
	if !errors.Is(err, ErrNotFound) {
		t.Fatalf("err = %v, want ErrNotFound", err)
	}
	for _, want := range []string{"cuBLAS", "libqvd-no-such.so.1", "QVD_TEST_NO_SUCH_LIB"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
}

func TestEnvOverridesSearch(t *testing.T) {
	t.Setenv("QVD_TEST_LIB", "/nowhere/libx.so")
	got := Spec{Env: "QVD_TEST_LIB", Names: []string{"liby.so"}}.Candidates()
	if len(got) != 1 || got[0] != "/nowhere/libx.so" {
		t.Fatalf("candidates = %v", got)
	}
}

func TestOpenAndBindLibc(t *testing.T) {
	l, err := Open(Spec{What: "libc", Names: []string{"libc.so.6"}})
	if err != nil {
		t.Skipf("no libc.so.6 to load here: %v", err)
	}
	defer l.Close()
	var strlen func(string) int
	if err := l.Bind(&strlen, "strlen"); err != nil {
		t.Fatal(err)
	}
	if n := strlen("qvd\x00"); n != 3 {
		t.Fatalf("strlen = %d", n)
	}
	var missing func()
	if err := l.Bind(&missing, "qvd_no_such_symbol"); err == nil || !strings.Contains(err.Error(), "qvd_no_such_symbol") {
		t.Fatalf("binding a missing symbol: %v", err)
	}
}
