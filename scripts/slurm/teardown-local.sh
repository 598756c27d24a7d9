#!/usr/bin/env bash
# teardown-local.sh — stop the one-node SLURM that setup-local.sh started: slurmd, slurmctld
# and munged, each by the PID in its pid file. Leaves the packages, slurm.conf and state.
set -uo pipefail

[ "$(id -u)" = 0 ] || { echo "teardown-local: run as root" >&2; exit 1; }

stop() { # name pidfile
	[ -s "$2" ] || return 0
	local pid
	pid=$(cat "$2")
	if kill -0 "$pid" 2>/dev/null; then
		echo "teardown-local: stopping $1 (pid $pid)"
		kill "$pid"
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		kill -0 "$pid" 2>/dev/null && { echo "teardown-local: $1 still running; SIGKILL"; kill -9 "$pid"; }
	fi
	rm -f "$2"
}
stop slurmd /run/slurmd.pid
stop slurmctld /run/slurmctld.pid
if [ "${1:-}" != --keep-munge ]; then
	stop munged /run/munge/munged.pid
fi
