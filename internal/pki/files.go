package pki

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

// WriteDir makes a cluster's files in dir (created if missing): ca.pem and ca-key.pem, and
// HOST.pem and HOST-key.pem for each host, named by its first name (an IPv6 literal's colons
// become underscores). With an existing ca.pem and ca-key.pem in dir it issues the hosts'
// certificates from that CA. It never overwrites a file: it checks that none exists before
// writing any, and creates each exclusively. progress hears what it does ("using the existing
// CA ...", "wrote ...").
func WriteDir(dir string, hosts [][]string, validity time.Duration, now time.Time, progress func(string)) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	caCert, caKey := filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	var ca *CA
	certPEM, err1 := os.ReadFile(caCert)
	keyPEM, err2 := os.ReadFile(caKey)
	switch {
	case err1 == nil && err2 == nil:
		var err error
		if ca, err = LoadCA(certPEM, keyPEM); err != nil {
			return fmt.Errorf("existing CA in %s: %w", dir, err)
		}
		progress("using the existing CA " + caCert)
	case errors.Is(err1, fs.ErrNotExist) && errors.Is(err2, fs.ErrNotExist):
	default:
		return fmt.Errorf("%s needs both ca.pem and ca-key.pem, or neither (%v; %v)", dir, err1, err2)
	}

	type file struct {
		path string
		data []byte
		mode os.FileMode
	}
	var files []file
	if ca == nil {
		var err error
		if ca, err = NewCA(validity, now); err != nil {
			return err
		}
		files = append(files, file{caCert, ca.CertPEM, 0o644}, file{caKey, ca.KeyPEM, 0o600})
	}
	for _, names := range hosts {
		cert, key, err := ca.Issue(names, validity, now)
		if err != nil {
			return err
		}
		base := strings.ReplaceAll(names[0], ":", "_") // IPv6 literals in file names
		files = append(files, file{filepath.Join(dir, base+".pem"), cert, 0o644}, file{filepath.Join(dir, base+"-key.pem"), key, 0o600})
	}
	for _, f := range files {
		if _, err := os.Lstat(f.path); err == nil {
			return fmt.Errorf("%s exists; not overwriting it (remove it, or use another --out)", f.path)
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	for _, f := range files {
		// O_EXCL: a file that appeared since the check is still not overwritten.
		w, err := os.OpenFile(f.path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, f.mode)
		if err != nil {
			return err
		}
		_, err = w.Write(f.data)
		if cerr := w.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("writing %s: %w", f.path, err)
		}
		progress("wrote " + f.path)
	}
	return nil
}
