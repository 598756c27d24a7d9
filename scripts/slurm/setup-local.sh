#!/usr/bin/env bash
# setup-local.sh — a one-node SLURM cluster on this machine, for testing qvd's SLURM support
# (scripts/slurm/test.sh). Idempotent: run it again and it only starts what is not running.
#
#   sudo scripts/slurm/setup-local.sh        # install (Debian/Ubuntu), configure, start
#   scripts/slurm/teardown-local.sh          # stop the daemons it started
#
# It installs slurm-wlm and munge if missing, creates the munge key and directories, starts
# munged, writes /etc/slurm/slurm.conf for one node named after `hostname` (CPUs, cores and
# memory as `slurmd -C` reports them; a partition with OverSubscribe=YES), starts slurmctld
# and slurmd, and waits until `sinfo` shows the node idle (resuming it if drained).
# An existing slurm.conf that this script did not write is left alone (FORCE=1 replaces it).
# Not for production: SlurmUser=root, no cgroups, no accounting.
set -euo pipefail

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
MARK="# written by qvd scripts/slurm/setup-local.sh"
SPOOL=/var/spool/slurmd
STATE=/var/spool/slurmctld
LOGDIR=/var/log/slurm
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
PARTITION=${QVD_SLURM_PARTITION:-qvd}

log() { echo "setup-local: $*"; }
die() { echo "setup-local: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "run as root (it installs packages and starts daemons)"

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# 1. Packages.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null || ! command -v sbatch >/dev/null; then
	log "installing slurm-wlm and munge"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi

# 2. munge: key (1024 random bytes, munge:munge 0400), directories, daemon.
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
	log "creating /etc/munge/munge.key"
	dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! alive "$MUNGE_PID"; then
	log "starting munged"
	rm -f /run/munge/munge.socket.2 /run/munge/munge.socket.2.lock
	runuser -u munge -- /usr/sbin/munged --pid-file="$MUNGE_PID"
	for _ in $(seq 50); do alive "$MUNGE_PID" && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || die "munge does not work (munge -n | unmunge failed)"

# 3. slurm.conf for this one node.
host=$(hostname -s)
node_line=$(slurmd -C | head -1) # NodeName=... CPUs=... Boards=... ... RealMemory=...
case $node_line in NodeName=*) ;; *) die "unexpected \`slurmd -C\` output: $node_line" ;; esac
# Leave headroom below the memory slurmd measures, or a small fluctuation marks the node invalid.
mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
node_line=$(sed "s/RealMemory=[0-9]*/RealMemory=$((mem * 9 / 10))/" <<<"$node_line")
install -d -m 0755 "$CONF_DIR" "$SPOOL" "$STATE" "$LOGDIR"
new_conf=$(cat <<CONF
$MARK
ClusterName=qvd-local
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmdSpoolDir=$SPOOL
StateSaveLocation=$STATE
SlurmctldLogFile=$LOGDIR/slurmctld.log
SlurmdLogFile=$LOGDIR/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MinJobAge=600
$node_line State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
)
if [ -f "$CONF" ] && ! grep -qxF "$MARK" "$CONF" && [ "${FORCE:-0}" != 1 ]; then
	die "$CONF exists and was not written by this script; FORCE=1 replaces it"
fi
changed=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$new_conf" ]; then
	log "writing $CONF ($node_line)"
	printf '%s\n' "$new_conf" >"$CONF"
	changed=1
fi

# 4. Daemons. A changed config needs them restarted.
stop() { # pidfile
	if alive "$1"; then
		local pid
		pid=$(cat "$1")
		kill "$pid"
		for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
	fi
}
if [ $changed = 1 ]; then
	stop "$SLURMD_PID"
	stop "$CTLD_PID"
fi
if ! alive "$CTLD_PID"; then
	log "starting slurmctld"
	slurmctld
	for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
fi
if ! alive "$SLURMD_PID"; then
	log "starting slurmd"
	slurmd
fi

# 5. Wait for the node to be idle (or mixed/allocated: jobs may already run on it).
for i in $(seq 150); do
	state=$(sinfo -h -n "$host" -o %T 2>/dev/null | head -1)
	case $state in
	idle* | mixed* | allocated*)
		log "node $host is $state; partition $PARTITION ready"
		sinfo
		exit 0
		;;
	drain* | down* | inval* | fail*)
		log "node $host is $state; resuming it"
		scontrol update nodename="$host" state=resume || true
		;;
	esac
	sleep 0.2
done
sinfo -N -l || true
scontrol show node "$host" | grep -i reason || true
die "node $host did not become idle (see $LOGDIR/slurmd.log and slurmctld.log)"
