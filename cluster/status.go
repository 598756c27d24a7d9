package cluster

import (
	"context"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/qvd/qvd/internal/memstat"
	"go.uber.org/zap"
)

// Status joins the cluster through peer as an observer (it never takes a rank), reads the
// member list with everyone's metadata, and leaves. The observer binds a free port on
// cfg.Bind's host, so it can run beside a member on the same machine; cfg.NodeName must
// differ from every member's (DefaultConfig's name does). The observer itself is not
// listed.
func Status(ctx context.Context, cfg Config, peer string, log *zap.Logger) ([]Member, error) {
	ip, _, err := splitIPPort(cfg.Bind)
	if err != nil {
		return nil, fmt.Errorf("%w: cluster.bind: %w", ErrConfig, err)
	}
	cfg.Bind = net.JoinHostPort(ip.String(), "0")
	n, err := New(cfg, Meta{Role: RoleObserver}, log)
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	defer func() { _ = n.Close() }()
	if err := n.Join(ctx, peer); err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	var out []Member
	for _, m := range n.Members() {
		if m.Name != n.LocalName() {
			out = append(out, m)
		}
	}
	return out, nil
}

// FormatStatus prints members as a table: ranked members by rank, then the others by name.
func FormatStatus(w io.Writer, members []Member) error {
	ms := slices.Clone(members)
	slices.SortStableFunc(ms, func(a, b Member) int {
		ra, rb := a.Meta.Rank, b.Meta.Rank
		switch {
		case ra >= 0 && rb >= 0 && ra != rb:
			return ra - rb
		case ra >= 0 && rb < 0:
			return -1
		case ra < 0 && rb >= 0:
			return 1
		}
		return strings.Compare(a.Name, b.Name)
	})
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAME\tADDRESS\tSTATE\tROLE\tRANK\tDEVICES\tJOB\tSTEP\tMODEL MEM")
	for _, m := range ms {
		rank, step := "-", "-"
		if m.Meta.Rank >= 0 {
			rank = strconv.Itoa(m.Meta.Rank)
			step = strconv.FormatInt(m.Meta.Step, 10)
		}
		job := m.Meta.Job
		if job == "" {
			job = "-"
		}
		mem := "-"
		if m.Meta.ModelBytes > 0 {
			mem = memstat.FormatBytes(m.Meta.ModelBytes)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", m.Name, m.Addr, m.State, m.Meta.Role, rank, m.Meta.Devices, job, step, mem)
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("print status: %w", err)
	}
	return nil
}
