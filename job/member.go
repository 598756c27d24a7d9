package job

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/qvd/qvd/cluster"
	"github.com/qvd/qvd/collective"
	"github.com/qvd/qvd/collective/grpcnet"
	"github.com/qvd/qvd/collective/shmnet"
	"github.com/qvd/qvd/collective/tcpnet"
	"github.com/qvd/qvd/internal/memstat"
	"github.com/qvd/qvd/internal/version"
)

// MemberOptions are this node's own settings (qvd's --bind, --grpc-bind, --advertise,
// --node-name, --cluster-key-file and --tls-* flags); empty fields take the cluster
// config's values.
type MemberOptions struct {
	Bind, GRPCBind, Advertise, NodeName string
	// KeyFile holds the cluster key; "" reads $QVD_CLUSTER_KEY (LoadClusterKey).
	KeyFile string
	// TLS are the files the flags name (all empty: none given; see ResolveTLS).
	TLS cluster.TLSConfig
	// Getenv reads QVD_CLUSTER_KEY and QVD_TLS_*; nil is an empty environment.
	Getenv func(string) string
}

// Member is this process's place in a cluster: the gossip node, the gRPC server (control
// plane and the gRPC data path), and the raw-TCP data-plane listener.
type Member struct {
	node   *cluster.Node
	key    []byte
	tls    *cluster.TLS      // nil without TLS
	tlsCfg cluster.TLSConfig // the files tls came from
	server *grpc.Server
	hub    *grpcnet.Hub
	tcp    *tcpnet.Listener
	// grpcLis is the gRPC server's listener; it keeps the connections it accepted, so
	// Close can end those gRPC has not finished with.
	grpcLis *trackingListener
	log     *zap.Logger

	wg      sync.WaitGroup
	stop    chan struct{}
	closeMu sync.Once
}

// StartMember starts the gRPC server and data listener on the gossip bind host (gRPC on the
// gossip port + 1 unless the gossip port is 0), then the gossip node advertising them.
// tlsc is the config's tls section (a worker passes none: see ResolveTLS).
func StartMember(ccfg cluster.Config, tlsc cluster.TLSConfig, role, job string, f MemberOptions, log *zap.Logger) (*Member, error) {
	key, err := LoadClusterKey(f.KeyFile, f.Getenv, log)
	if err != nil {
		return nil, err
	}
	tlsc, id, err := LoadTLS(f.TLS, f.Getenv, tlsc, log)
	if err != nil {
		return nil, err
	}
	ccfg.TLS = id
	if f.Bind != "" {
		ccfg.Bind = f.Bind
	}
	if f.Advertise != "" {
		ccfg.Advertise = f.Advertise
	}
	if f.NodeName != "" {
		ccfg.NodeName = f.NodeName
	}
	if ccfg.NodeName == "" {
		ccfg.NodeName = cluster.DefaultConfig().NodeName
	}
	ccfg.Key = key
	if err := ccfg.Validate(); err != nil {
		return nil, err
	}
	host, portStr, err := net.SplitHostPort(ccfg.Bind)
	if err != nil {
		return nil, fmt.Errorf("--bind %q: %w", ccfg.Bind, err)
	}
	gport, _ := strconv.Atoi(portStr)
	grpcBind := f.GRPCBind
	if grpcBind == "" {
		grpcPort := 0
		if gport != 0 {
			grpcPort = gport + 1
		}
		grpcBind = net.JoinHostPort(host, strconv.Itoa(grpcPort))
	}
	adv := advertiseHost(host, ccfg.Advertise)

	m := &Member{key: key, tls: id, tlsCfg: tlsc, log: log, stop: make(chan struct{})}
	lis, err := net.Listen("tcp", grpcBind)
	if err != nil {
		return nil, fmt.Errorf("gRPC listener: %w", err)
	}
	tcfg := tcpnet.DefaultConfig()
	if id != nil {
		tcfg.TLS = &tcpnet.TLS{Server: id.ServerConfig(), Client: id.ClientConfig()}
	}
	m.tcp, err = tcpnet.ListenWith(net.JoinHostPort(host, "0"), tcfg, log)
	if err != nil {
		lis.Close()
		return nil, fmt.Errorf("data-plane listener: %w", err)
	}
	opts := append(cluster.ServerOptions(key, id, log), grpcnet.ServerOptions()...)
	// A connection has 10 s, not gRPC's default 120 s, to finish its TLS and HTTP/2
	// handshakes: strangers that connect and stall hold a goroutine and a socket each.
	opts = append(opts, grpc.ConnectionTimeout(10*time.Second))
	m.server = grpc.NewServer(opts...)
	_, tcpPort, _ := net.SplitHostPort(m.tcp.Addr())
	meta := cluster.Meta{
		Version: version.Version, Role: role, Job: job, Rank: -1, Gen: uint64(time.Now().UnixNano()),
		Memory: memstat.NewReader().Read().Available, // host memory; GPU memory joins with the GPU engine
		GRPC:   net.JoinHostPort(adv, strconv.Itoa(lis.Addr().(*net.TCPAddr).Port)),
		Data:   net.JoinHostPort(adv, tcpPort),
		Host:   shmHost(log),
	}
	m.node, err = cluster.New(ccfg, meta, log)
	if err != nil {
		lis.Close()
		m.tcp.Close()
		return nil, err
	}
	m.node.Register(m.server)
	m.hub = grpcnet.NewHub(m.server, log)
	m.grpcLis = &trackingListener{Listener: grpcnet.Listener(lis), conns: map[*trackedConn]struct{}{}}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		if err := m.server.Serve(m.grpcLis); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
			log.Error("gRPC server stopped", zap.Error(err))
		}
	}()
	log.Info("cluster member started", zap.String("name", m.node.LocalName()), zap.String("gossip", m.node.LocalAddr()),
		zap.String("grpc", meta.GRPC), zap.String("data", meta.Data), zap.String("role", role), zap.Bool("mutual_tls", id != nil))
	return m, nil
}

// advertiseHost is the host others should dial: the advertise flag's, or the bind host, or
// for a wildcard bind this machine's first non-loopback address.
func advertiseHost(bindHost, advertise string) string {
	if advertise != "" {
		if h, _, err := net.SplitHostPort(advertise); err == nil {
			return h
		}
		return advertise
	}
	ip := net.ParseIP(bindHost)
	if bindHost != "" && (ip == nil || !ip.IsUnspecified()) {
		return bindHost
	}
	addrs, err := net.InterfaceAddrs()
	if err == nil {
		for _, a := range addrs {
			if n, ok := a.(*net.IPNet); ok && !n.IP.IsLoopback() && n.IP.To4() != nil {
				return n.IP.String()
			}
		}
	}
	return "127.0.0.1"
}

// DataPlane is a job's communicator and the transports under it, which it does not close.
type DataPlane struct {
	// Comm is the communicator; a caller may replace it with one stacked on it (NCCLOver),
	// which Close then closes instead.
	Comm       collective.Communicator
	Plan       collective.Plan
	Wire       *collective.WireCounts // bytes per collective, summed over the transports
	transports []collective.Transport
}

// Close closes the communicator, then its transports; safe twice.
func (d *DataPlane) Close() {
	d.Comm.Close()
	for _, t := range d.transports {
		t.Close()
	}
}

// Communicator builds the data plane over the roster for collective.transport: a ring over
// shared memory, TCP or gRPC, or the hierarchical composition of a shared-memory ring
// within each host and a TCP ring per local rank across hosts (collective.ChooseTransport
// decides from the members' host ids). nccl gets the gRPC ring, which bootstraps it.
func (m *Member) Communicator(ctx context.Context, r *cluster.Roster, cfg collective.Config) (*DataPlane, error) {
	hosts := make([]string, len(r.Members))
	for i, mm := range r.Members {
		hosts[i] = mm.Host
	}
	topo, err := collective.NewTopology(hosts, r.Rank)
	if err != nil {
		return nil, err
	}
	requested := cfg.Transport
	if requested == collective.TransportNCCL {
		requested = collective.TransportGRPC
	}
	plan, reason, err := collective.ChooseTransport(requested, topo, nil)
	if err != nil {
		return nil, err
	}
	if cfg.Transport == collective.TransportAuto {
		m.log.Info("data plane chosen", zap.String("plan", string(plan)), zap.String("why", reason))
	}
	d := &DataPlane{Plan: plan, Wire: &collective.WireCounts{}}
	ring := func(t collective.Transport, cfg collective.Config) (collective.Communicator, error) {
		t = collective.CountInto(t, d.Wire)
		d.transports = append(d.transports, t)
		return collective.NewRing(t, cfg)
	}
	fail := func(err error) (*DataPlane, error) {
		for _, t := range d.transports {
			t.Close()
		}
		return nil, fmt.Errorf("%s data path: %w", plan, err)
	}
	if plan != collective.PlanHierarchical {
		var t collective.Transport
		switch plan {
		case collective.PlanShm:
			t, err = m.shmTransport(ctx, r, r.Job, topo.Local, topo.LocalRank)
		case collective.PlanTCP:
			t, err = m.tcpTransport(ctx, r, r.Job, allRanks(r.World), r.Rank)
		default:
			addrs := make([]string, len(r.Members))
			for i, mm := range r.Members {
				addrs[i] = mm.GRPC
			}
			t, err = m.hub.Transport(ctx, grpcnet.Group{Roster: collective.Roster{Job: r.Job, Rank: r.Rank, Addrs: addrs, Secret: r.Secret},
				DialOptions: cluster.DialOptions(m.key, m.tls)})
		}
		if err != nil {
			return fail(err)
		}
		rcfg := cfg
		if plan == collective.PlanShm {
			rcfg = cfg.ForShm()
		}
		if d.Comm, err = ring(t, rcfg); err != nil {
			return fail(err)
		}
		return d, nil
	}
	// Hierarchical: every host's ranks form a shared-memory group, and the ranks with the
	// same local rank form a TCP group across hosts, named apart on the shared listener.
	lt, err := m.shmTransport(ctx, r, r.Job, topo.Local, topo.LocalRank)
	if err != nil {
		return fail(err)
	}
	local, err := ring(lt, cfg.ForShm())
	if err != nil {
		return fail(err)
	}
	ct, err := m.tcpTransport(ctx, r, crossJob(r.Job, topo.LocalRank), topo.Cross, topo.CrossRank)
	if err != nil {
		local.Close()
		return fail(err)
	}
	cross, err := ring(ct, cfg)
	if err != nil {
		local.Close()
		return fail(err)
	}
	if d.Comm, err = collective.NewHierarchical(local, cross, topo); err != nil {
		local.Close()
		cross.Close()
		return fail(err)
	}
	return d, nil
}

// shmTransport joins the shared-memory group of the global ranks in group (this rank at
// index rank).
func (m *Member) shmTransport(ctx context.Context, r *cluster.Roster, job string, group []int, rank int) (collective.Transport, error) {
	names := make([]string, len(group))
	for i, g := range group {
		names[i] = r.Members[g].Name
	}
	return shmnet.New(ctx, shmnet.Group{Job: job, Rank: rank, Size: len(group), Secret: r.Secret, Addrs: names},
		shmnet.DefaultConfig(), m.log)
}

// tcpTransport joins the raw-TCP group of the global ranks in group (this rank at index
// rank) as job, and connects to its ring neighbours now, so that an unreachable neighbour
// is reported at start, not at the first collective.
func (m *Member) tcpTransport(ctx context.Context, r *cluster.Roster, job string, group []int, rank int) (collective.Transport, error) {
	addrs := make([]string, len(group))
	for i, g := range group {
		addrs[i] = r.Members[g].Data
	}
	t, err := m.tcp.Transport(ctx, tcpnet.Group{Job: job, Rank: rank, Addrs: addrs, Secret: r.Secret})
	if err != nil {
		return nil, err
	}
	if c, ok := t.(tcpnet.Connector); ok && len(group) > 1 {
		if err := c.Connect(ctx, (rank+1)%len(group), (rank-1+len(group))%len(group)); err != nil {
			t.Close()
			return nil, err
		}
	}
	return t, nil
}

// crossJob names the TCP group of local rank l's cross-host ring: the job id with a suffix,
// shortened to a hash of the id where the result would exceed a job id's 64 characters.
func crossJob(job string, l int) string {
	suffix := ".x" + strconv.Itoa(l)
	if len(job)+len(suffix) > 64 {
		sum := sha256.Sum256([]byte(job))
		job = hex.EncodeToString(sum[:16])
	}
	return job + suffix
}

func allRanks(n int) []int {
	r := make([]int, n)
	for i := range r {
		r[i] = i
	}
	return r
}

// shmHost is the host id this member publishes: cluster.HostID where shared memory works
// here, else "" (the member then counts as a host of its own, and auto gives it TCP).
func shmHost(log *zap.Logger) string {
	id, err := cluster.HostID()
	if err == nil {
		err = shmnet.Available("")
	}
	if err != nil {
		log.Info("shared memory unavailable: this member's collectives use TCP", zap.Error(err))
		return ""
	}
	return id
}

// watchPeers calls lost with a description whenever a member of the roster leaves or fails,
// so collectives abort at once instead of waiting out their timeout; it stops with the
// member, or when stop closes (nil: never).
func (m *Member) watchPeers(r *cluster.Roster, lost func(error), stop <-chan struct{}) {
	ranks := map[string]int{}
	for i, mm := range r.Members {
		ranks[mm.Name] = i
	}
	// A graceful departure aborts only after leftGrace (see onDeparture). If the member left
	// because it failed, its connections closed and the collectives name it by themselves.
	left := make(chan error, len(r.Members))
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		for {
			select {
			case <-m.stop:
				return
			case <-stop:
				return
			case err := <-left:
				m.log.Error("lost a member of the job", zap.Error(err))
				lost(err)
			case ev, ok := <-m.node.Events():
				if !ok {
					return
				}
				rank, in := ranks[ev.Member.Name]
				switch onDeparture(ev.Kind, in, rank, r.Rank) {
				case ignoreDeparture:
					continue
				case abortAfterGrace:
					err := fmt.Errorf("rank %d (%s at %s) left the cluster", rank, ev.Member.Name, ev.Member.Addr)
					m.log.Info("a member of the job left", zap.Error(err))
					m.wg.Add(1)
					go func() {
						defer m.wg.Done()
						t := time.NewTimer(leftGrace)
						defer t.Stop()
						select {
						case <-t.C:
							select {
							case left <- err:
							case <-stop: // the watch ended: nobody reads left
							}
						case <-m.stop:
						case <-stop:
						}
					}()
					continue
				}
				err := &memberFailed{rank: rank, name: ev.Member.Name, addr: ev.Member.Addr}
				m.log.Error("lost a member of the job", zap.Error(err))
				lost(err)
			}
		}
	}()
}

// memberFailed is gossip's report that a member of the job failed; an elastic job leaves
// the member it names out of the next generation.
type memberFailed struct {
	rank       int
	name, addr string
}

func (e *memberFailed) Error() string {
	return fmt.Sprintf("rank %d (%s at %s) failed (no longer answers gossip)", e.rank, e.name, e.addr)
}

// departure is what a rank does when gossip reports a member of its job gone.
type departure int

const (
	ignoreDeparture departure = iota // not a member of this job, this rank itself, or no departure
	abortAfterGrace                  // it left gracefully: usually it has just finished the job
	abortNow                         // the failure detector declared it dead (killed, hung, cut off)
)

// onDeparture decides for an event about a member: inRoster says whether it is in this job, at
// rank; self is this rank. A graceful departure aborts only after leftGrace because a worker
// that finished the job leaves while a rank a moment behind is still reading the last
// collective's data from its sockets: aborting at once failed that rank (the compose test's
// "coordinator exit 1 after a completed job").
func onDeparture(kind cluster.EventKind, inRoster bool, rank, self int) departure {
	switch {
	case !inRoster || rank == self:
		return ignoreDeparture
	case kind == cluster.Left:
		return abortAfterGrace
	case kind == cluster.Failed:
		return abortNow
	}
	return ignoreDeparture
}

// leftGrace is how long a graceful departure waits before it aborts this rank's collectives.
const leftGrace = 3 * time.Second

// Node is the member's gossip node: rendezvous (Coordinate, AwaitRoster), metadata, events.
func (m *Member) Node() *cluster.Node { return m.node }

// TLSConfig is the files the member's TLS identity came from (empty without TLS).
func (m *Member) TLSConfig() cluster.TLSConfig { return m.tlsCfg }

// Close leaves the cluster gracefully and stops the servers; safe twice.
func (m *Member) Close() {
	m.closeMu.Do(func() {
		close(m.stop)
		_ = m.node.Close()
		m.hub.Close()
		stopped := make(chan struct{})
		go func() { m.server.GracefulStop(); close(stopped) }()
		select {
		case <-stopped:
		case <-time.After(2 * time.Second):
			// Stop waits for every accepted connection's handler, and one still in its
			// handshake (a stranger that connected and sent nothing) waits up to gRPC's
			// 120 s connection timeout: close the raw connections first.
			m.grpcLis.closeConns()
			m.server.Stop()
		}
		m.tcp.Close()
		m.wg.Wait()
	})
}

// NewJobID names a job: the run name and a random suffix.
func NewJobID(name string) string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	id := name + "-" + hex.EncodeToString(b[:])
	if len(id) > 64 {
		id = id[len(id)-64:]
	}
	return strings.Trim(id, "-")
}

// trackingListener remembers the connections it accepted until they are closed.
type trackingListener struct {
	net.Listener
	mu    sync.Mutex
	conns map[*trackedConn]struct{}
}

func (l *trackingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	tc := &trackedConn{Conn: c, l: l}
	l.mu.Lock()
	l.conns[tc] = struct{}{}
	l.mu.Unlock()
	return tc, nil
}

// closeConns closes every accepted connection still open.
func (l *trackingListener) closeConns() {
	l.mu.Lock()
	conns := make([]*trackedConn, 0, len(l.conns))
	for c := range l.conns {
		conns = append(conns, c)
	}
	l.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
}

type trackedConn struct {
	net.Conn
	l    *trackingListener
	once sync.Once
}

func (c *trackedConn) Close() error {
	c.once.Do(func() {
		c.l.mu.Lock()
		delete(c.l.conns, c)
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}
