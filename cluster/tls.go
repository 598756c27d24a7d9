package cluster

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Mutual TLS between the nodes of a cluster.
//
// Every node holds the cluster's CA certificate and its own certificate and key, signed by
// that CA. Every gRPC connection (control plane, gRPC data path) and every raw-TCP data
// connection then runs TLS 1.3 with certificates required and verified on both ends.
//
// Names are not checked. Peers dial each other at whatever address gossip advertised — an IP
// literal, usually, and behind NAT not the one the certificate could name — so verification
// is of the chain only: a peer is a member if its certificate chains to the cluster's CA
// (and is valid now, for its end of the connection). This is sound because the CA is private
// to the cluster: it signs the cluster's node certificates and nothing else. Do not use a
// public CA, or a company CA that signs other services, as a cluster CA: anything it signed
// would be admitted. The node certificates of `qvd certs` still carry their hosts' names and
// addresses, for other tools.
//
// The cluster key's HMAC on every gRPC call (auth.go) and the job secret's hello on every
// data connection stay on under TLS, inside the encrypted channel: a node must hold both a
// certificate and the key.

// TLSConfig names the PEM files of a node's mutual-TLS identity: the `tls` section of qvd's
// configuration, or the --tls-ca, --tls-cert and --tls-key flags. Give all three or none;
// none means plain TCP (gRPC still authenticated by the cluster key, see auth.go).
type TLSConfig struct {
	// CA is the cluster's certificate authority: one or more PEM certificates. Peers must
	// present a certificate that chains to one of them.
	CA string `yaml:"ca" json:"ca"`
	// Cert is this node's certificate (PEM), signed by CA, followed by any intermediates.
	Cert string `yaml:"cert" json:"cert"`
	// Key is Cert's private key (PEM: PKCS#8, SEC 1 EC or PKCS#1 RSA). Keep it mode 0600
	// (Load warns when group or others may read it).
	Key string `yaml:"key" json:"key"`
}

// Enabled reports whether any file is named.
func (c TLSConfig) Enabled() bool { return c.CA != "" || c.Cert != "" || c.Key != "" }

// Validate loads the files (see Load): a missing field, an unreadable file, a CA file without
// certificates or holding one that is not a CA's, a node certificate that is a CA's, a key
// that does not match its certificate or a certificate the CA did not sign is an error
// naming the field and the file.
func (c TLSConfig) Validate() error {
	_, err := c.Load(nil)
	return err
}

// Load reads the files into a TLS identity; nil, nil when no file is named. When log is not
// nil, a key file that group or others may read is warned about there (see ReadKeyFile).
func (c TLSConfig) Load(log *zap.Logger) (*TLS, error) {
	if !c.Enabled() {
		return nil, nil
	}
	var missing, have []string
	for _, f := range []struct{ name, path string }{{"ca", c.CA}, {"cert", c.Cert}, {"key", c.Key}} {
		if f.path == "" {
			missing = append(missing, f.name)
		} else {
			have = append(have, f.name)
		}
	}
	if len(missing) > 0 {
		return nil, configError(fmt.Sprintf("%s: missing: mutual TLS needs ca, cert and key together, or none of them (given: %s)",
			missing[0], strings.Join(have, ", ")))
	}
	read := func(field, path string) ([]byte, error) {
		var b []byte
		var err error
		if field == "key" {
			b, err = ReadKeyFile(path, log)
		} else {
			b, err = os.ReadFile(path)
		}
		if err != nil {
			return nil, configError(fmt.Sprintf("%s: %v", field, err))
		}
		return b, nil
	}
	ca, err := read("ca", c.CA)
	if err != nil {
		return nil, err
	}
	cert, err := read("cert", c.Cert)
	if err != nil {
		return nil, err
	}
	key, err := read("key", c.Key)
	if err != nil {
		return nil, err
	}
	return newTLS(c, ca, cert, key)
}

// TLS is a loaded mutual-TLS identity: the cluster's CA and this node's certificate. It is
// immutable and safe for concurrent use.
type TLS struct {
	cert        tls.Certificate
	roots       *x509.CertPool
	fingerprint string
}

// NewTLS makes a TLS identity from PEM text (Load reads it from files).
func NewTLS(caPEM, certPEM, keyPEM []byte) (*TLS, error) {
	return newTLS(TLSConfig{}, caPEM, certPEM, keyPEM)
}

// fingerprintLen is the length, in hex digits, of a CA fingerprint in node metadata. 32 bits
// tell two clusters' CAs apart well enough for a consistency check (the TLS handshake is the
// security), and keep the largest Meta within memberlist's 512 bytes (TestMetaFits).
const fingerprintLen = 8

func newTLS(files TLSConfig, caPEM, certPEM, keyPEM []byte) (*TLS, error) {
	// name says "ca (/etc/qvd/ca.pem)" when the text came from a file.
	name := func(field, path string) string {
		if path == "" {
			return field
		}
		return field + " (" + path + ")"
	}
	bad := func(field, format string, args ...any) error {
		return configError(field + ": " + fmt.Sprintf(format, args...))
	}
	cas, err := parseCerts(caPEM)
	if err != nil {
		return nil, bad("ca", "%s: %v", orText(files.CA), err)
	}
	if len(cas) == 0 {
		return nil, bad("ca", "%s holds no PEM certificate", orText(files.CA))
	}
	for i, c := range cas {
		if err := isCA(c); err != nil {
			return nil, bad("ca", "%s: certificate %d (%q) %v: the CA file holds the cluster CA's certificate (ca.pem of `qvd certs`), not a node's",
				orText(files.CA), i+1, c.Subject.CommonName, err)
		}
	}
	t := &TLS{roots: x509.NewCertPool()}
	h := sha256.New()
	for _, c := range cas {
		t.roots.AddCert(c)
		h.Write(c.Raw)
	}
	t.fingerprint = hex.EncodeToString(h.Sum(nil))[:fingerprintLen]

	chain, err := parseCerts(certPEM)
	if err != nil {
		return nil, bad("cert", "%s: %v", orText(files.Cert), err)
	}
	if len(chain) == 0 {
		return nil, bad("cert", "%s holds no PEM certificate", orText(files.Cert))
	}
	if err := isLeaf(chain[0]); err != nil {
		return nil, bad("cert", "%s: %q %v: a node's identity is a certificate the CA issued for it (HOST.pem of `qvd certs`), never the CA's own",
			orText(files.Cert), chain[0].Subject.CommonName, err)
	}
	t.cert, err = tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return nil, bad("key", "%s does not go with the certificate in %s: %v", orText(files.Key), orText(files.Cert), err)
	}
	// Check now what every peer will check, so a wrong file fails at start with its name,
	// not as a handshake failure on some other node.
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	for _, usage := range []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth} {
		if _, err := chain[0].Verify(x509.VerifyOptions{Roots: t.roots, Intermediates: inter, KeyUsages: []x509.ExtKeyUsage{usage}}); err != nil {
			return nil, bad("cert", "%s is not valid under the CA in %s: %v", name("certificate", files.Cert), orText(files.CA), err)
		}
	}
	return t, nil
}

// isCA refuses a certificate that may not sign others: a CA needs the basic constraints
// extension with CA:TRUE (RFC 5280 §4.2.1.9) and, when it states key usages, keyCertSign
// (§4.2.1.3). Go's verifier trusts any certificate put in a root pool, so without this check
// a node certificate given as the CA would be accepted, and would admit only itself.
func isCA(c *x509.Certificate) error {
	switch {
	case !c.BasicConstraintsValid || !c.IsCA:
		return errors.New("is not a CA certificate (basic constraints CA:FALSE or absent)")
	case c.KeyUsage != 0 && c.KeyUsage&x509.KeyUsageCertSign == 0:
		return errors.New("is not a CA certificate (its key usage lacks certificate signing)")
	}
	return nil
}

// isLeaf refuses a CA certificate as a node's identity: a node holding the CA's key could
// issue certificates to anyone, and the CA's key belongs offline (see pki.CA).
func isLeaf(c *x509.Certificate) error {
	switch {
	case c.BasicConstraintsValid && c.IsCA:
		return errors.New("is a CA certificate (basic constraints CA:TRUE)")
	case c.KeyUsage&x509.KeyUsageCertSign != 0:
		return errors.New("is a CA certificate (its key usage allows certificate signing)")
	}
	return nil
}

func orText(path string) string {
	if path == "" {
		return "the PEM text"
	}
	return path
}

// parseCerts parses the CERTIFICATE blocks of PEM text; other blocks are skipped.
func parseCerts(text []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for rest := bytes.TrimSpace(text); len(rest) > 0; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("certificate %d: %w", len(out)+1, err)
		}
		out = append(out, c)
	}
	return out, nil
}

// Fingerprint identifies the CA: the first 8 hex digits of SHA-256 over its certificates.
// Nodes advertise it in their metadata so that a node configured with another CA (or none)
// is refused at join with a clear error, rather than failing handshakes later.
func (t *TLS) Fingerprint() string { return t.fingerprint }

// ServerConfig returns a new TLS configuration for accepting connections: TLS 1.3, this
// node's certificate, client certificates required and verified against the CA.
func (t *TLS) ServerConfig() *tls.Config {
	return &tls.Config{
		MinVersion:   tls.VersionTLS13,
		Certificates: []tls.Certificate{t.cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    t.roots,
	}
}

// ClientConfig returns a new TLS configuration for dialling a peer: TLS 1.3, this node's
// certificate presented, the peer's verified against the CA but not against the dialled name
// (see the comment at the top of this file).
func (t *TLS) ClientConfig() *tls.Config {
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Always present our certificate, even when its issuer is not among the names the
		// server asks for: the server's refusal then says why ("unknown certificate
		// authority") instead of "no certificate".
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &t.cert, nil },
		// The standard verification checks the dialled name; VerifyConnection checks the
		// chain instead.
		InsecureSkipVerify: true,
		VerifyConnection:   t.verifyServer,
	}
}

// ErrPeerCertificate: a peer's certificate does not chain to the cluster's CA.
var ErrPeerCertificate = errors.New("cluster: peer certificate not signed by the cluster CA")

func (t *TLS) verifyServer(cs tls.ConnectionState) error {
	if len(cs.PeerCertificates) == 0 {
		return fmt.Errorf("%w: the peer presented no certificate", ErrPeerCertificate)
	}
	inter := x509.NewCertPool()
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
	}
	leaf := cs.PeerCertificates[0]
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: t.roots, Intermediates: inter,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
		return fmt.Errorf("%w: %q (issued by %q): %w", ErrPeerCertificate, leaf.Subject.CommonName, leaf.Issuer.CommonName, err)
	}
	return nil
}

// tlsProbeTimeout bounds explainTLS's handshake.
const tlsProbeTimeout = time.Second

// explainTLS adds the reason to a call that failed for want of a connection, when that
// reason is a TLS handshake refused by either end: gRPC's own error for a call that waited
// for a connection says only that the deadline passed. Other errors are returned as they are.
func (n *Node) explainTLS(addr string, err error) error {
	if n.cfg.TLS == nil {
		return err
	}
	if c := status.Code(err); c != codes.Unavailable && c != codes.DeadlineExceeded {
		return err
	}
	if perr := probeTLS(addr, n.cfg.TLS); perr != nil {
		return fmt.Errorf("%w (TLS with %s: %v)", err, addr, perr)
	}
	return err
}

// probeTLS runs a mutual-TLS handshake with a qvd gRPC server at addr and waits for the
// server's first bytes (its HTTP/2 settings): under TLS 1.3 a server that refuses our
// certificate says so only after our side of the handshake is done.
func probeTLS(addr string, t *TLS) error {
	ctx, cancel := context.WithTimeout(context.Background(), tlsProbeTimeout)
	defer cancel()
	cfg := t.ClientConfig()
	cfg.NextProtos = []string{"h2"} // gRPC servers refuse clients that do not offer HTTP/2
	d := tls.Dialer{Config: cfg}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	dl, _ := ctx.Deadline()
	_ = c.SetReadDeadline(dl)
	var b [1]byte
	if _, err := c.Read(b[:]); err != nil {
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			return nil // no answer yet is not a refusal
		}
		return err
	}
	return nil
}
