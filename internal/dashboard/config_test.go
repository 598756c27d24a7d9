package dashboard

import (
	"strings"
	"testing"
)

func TestDashboardConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		addr, wantErr string
	}{
		{"", ""},
		{"127.0.0.1:8080", ""},
		{":0", ""},
		{"[::1]:9000", ""},
		{"localhost", "want HOST:PORT"},
		{"host:http", "port must be 0-65535"},
		{"host:70000", "port must be 0-65535"},
		{"host:-1", "port must be 0-65535"},
	} {
		err := Config{Addr: tc.addr}.Validate()
		if tc.wantErr == "" && err != nil {
			t.Errorf("%q: %v, want valid", tc.addr, err)
		}
		if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
			t.Errorf("%q: %v, want an error containing %q", tc.addr, err, tc.wantErr)
		}
	}
}
