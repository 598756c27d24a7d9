#!/usr/bin/env bash
# Hierarchical against flat collectives on two "machines": two network namespaces joined by a
# veth pair, each with its own IPC namespace and /dev/shm (so cluster.HostID tells them apart,
# as it would two hosts). Each runs `qvd bench allreduce --nnodes 2 --node-rank R --nproc
# NPROC`; `--transport auto` becomes hierarchical (shared memory within a namespace, TCP
# across), `--transport tcp` the flat TCP ring over the same link. Rounds are interleaved;
# prints the median in-place busbw of each, with every run's figure.
#   sudo bench/compare-hierarchical.sh [SIZE] [ROUNDS]     (default 64MiB, 5; NPROC=2, ITERS=10)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-64MiB}
rounds=${2:-5}
nproc=${NPROC:-2}
[ "$(id -u)" -eq 0 ] || { echo "compare-hierarchical: needs root (network and IPC namespaces)" >&2; exit 1; }
go build -o bin/qvd ./cmd/qvd
a=qvdh-a$$ b=qvdh-b$$
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$a"
ip netns add "$b"
ip link add "va$$" type veth peer name "vb$$"
ip link set "va$$" netns "$a"
ip link set "vb$$" netns "$b"
ip -n "$a" addr add 10.78.0.1/24 dev "va$$"
ip -n "$b" addr add 10.78.0.2/24 dev "vb$$"
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set "va$$" up
ip -n "$b" link set "vb$$" up
QVD_CLUSTER_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
export QVD_CLUSTER_KEY
# run TRANSPORT: one two-node run; prints rank 0's in-place busbw (and fails on #wrong).
run() {
  local pids=() r ns
  for r in 0 1; do
    ns=$a; [ "$r" = 1 ] && ns=$b
    ip netns exec "$ns" unshare --ipc --mount sh -c "mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec bin/qvd bench allreduce \
      --nnodes 2 --node-rank $r --nproc $nproc --master-addr 10.78.0.1 --master-port 29500 --transport $1 --sizes $size --iters ${ITERS:-10}" \
      >"/tmp/qvdh-$$-$r.log" 2>"/tmp/qvdh-$$-$r.err" &
    pids+=($!)
  done
  # stderr (the workers' logs) apart: a log line "[rank 0] 13:27:55 WARN ..." would pass
  # for a data line.
  local ok=1 p
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  ((ok)) || { tail -20 /tmp/qvdh-$$-*.log /tmp/qvdh-$$-*.err >&2; return 1; }
  grep -q "hierarchical\|tcp transport" "/tmp/qvdh-$$-0.log"
  awk '/^\[rank 0\] +[0-9]/ { if ($NF != 0) { print "wrong-result"; exit 1 } print $(NF-1) }' "/tmp/qvdh-$$-0.log"
  rm -f /tmp/qvdh-$$-*.log /tmp/qvdh-$$-*.err
}
declare -A res
for _ in $(seq "$rounds"); do
  for t in auto tcp; do
    res[$t]+="$(run "$t") "
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
printf "%-28s %12s   %s\n" "2 nodes × $nproc ranks, $size" "busbw(GB/s)" "all runs"
printf "%-28s %12s   %s\n" "auto (hierarchical)" "$(echo "${res[auto]}" | median)" "${res[auto]}"
printf "%-28s %12s   %s\n" "tcp (flat ring)" "$(echo "${res[tcp]}" | median)" "${res[tcp]}"
