#!/usr/bin/env bash
# The docker-compose multi-node test: four containers on a private network (docker-compose.yml)
# form a cluster by gossip and train together.
#
#   1. train: a short job runs to completion; every rank must exit 0 with the same final weights
#      (SHA-256 of the parameters), and the test accuracy must be the single process's with the
#      same global batch.
#      Each container has its own IPC namespace, so collective.transport auto must choose TCP.
#   2. partition: mid-training, one worker is cut off the network (docker network disconnect);
#      the others must fail within the deadline with an error naming its rank, and the last
#      checkpoint must be intact: it verifies and a single process resumes from it.
#
#   scripts/compose-test.sh            (needs docker, docker-compose and dataset-fashion-mnist)
#   3. shared IPC: the same job with the workers in the coordinator's IPC namespace; auto must
#      choose shared memory, and the weights must be bit-identical to scenario 1's (the same
#      ring, the same reduction order, another data plane).
# Exits 0 when all pass; prints what it checked. Leaves nothing running.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"

compose() { docker-compose -p qvdtest "$@"; }
log() { echo "compose-test: $*"; }
fail() { echo "compose-test: FAIL: $*" >&2; exit 1; }

data=${QVD_DATA:-/usr/share/datasets/fashion-mnist}
[ -f "$data/train-images-idx3-ubyte.gz" ] || fail "Fashion-MNIST not found in $data (apt-get install dataset-fashion-mnist)"
work=$(mktemp -d /tmp/qvd-compose.XXXXXX)
cleanup() {
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

scripts/docker-context.sh
docker build -q -t qvd:local . >/dev/null
go build -o bin/qvd ./cmd/qvd
export QVD_DATA="$data" QVD_RUNS="$work/runs"
mkdir -p "$QVD_RUNS"
compose down -v --remove-orphans >/dev/null 2>&1 || true

services=(coordinator worker1 worker2 worker3)

# wait_exit SECONDS SERVICE...: waits for the services' containers to stop and prints
# "service exit-code" lines; a container still running at the deadline reports "running".
wait_exit() {
  local deadline=$((SECONDS + $1)); shift
  local s id st
  for s in "$@"; do
    id=$(compose ps -q "$s")
    while [ "$(docker inspect -f '{{.State.Running}}' "$id")" = true ] && [ $SECONDS -lt $deadline ]; do
      sleep 1
    done
    st=$(docker inspect -f '{{if .State.Running}}running{{else}}{{.State.ExitCode}}{{end}}' "$id")
    echo "$s $st"
  done
}

# --- 1. train to completion ----------------------------------------------------------------
job=(--max-steps 60 --epochs 1 --train-subset 6000 --test-subset 1000 --seed 5 --quiet)
log "scenario 1: a 4-node job of ${job[*]}"
export QVD_RUN=train QVD_ARGS="${job[*]}"
start=$SECONDS
compose up -d --no-build >/dev/null 2>&1
codes=$(wait_exit 240 "${services[@]}")
compose logs --no-color > "$work/train.log" 2>&1
log "finished in $((SECONDS - start)) s: $(echo "$codes" | tr '\n' ' ')"
if echo "$codes" | awk '$2 != 0 {bad = 1} END {exit !bad}'; then
  for s in $(echo "$codes" | awk '$2 != 0 {print $1}'); do
    echo "--- last lines of $s:" >&2
    grep -E "^${s}_" "$work/train.log" | tail -25 >&2
  done
  fail "a node did not exit 0"
fi
hashes=$(grep -o '"weights_sha256": "[0-9a-f]*"' "$work/train.log" | sort | uniq -c)
[ "$(echo "$hashes" | wc -l)" -eq 1 ] && [ "$(echo "$hashes" | awk '{print $1}')" -eq 4 ] ||
  fail "the ranks ended with different weights: $hashes"
log "all 4 ranks end with the same weights: $(echo "$hashes" | awk '{print $3}')"
tcp_hash=$(echo "$hashes" | awk '{print $3}')
planned=$(grep -o '"data_plane": "[a-z]*"' "$work/train.log" | sort | uniq -c)
[ "$(echo "$planned" | awk '{print $1, $3}')" = '4 "tcp"' ] || fail "with private IPC namespaces auto should choose tcp on all 4 ranks: $planned"
log "auto chose TCP between containers: $(grep -E '^coordinator_' "$work/train.log" | grep -o '"why": "[^"]*"' | head -1)"
acc=$(grep -o 'test accuracy [0-9.]*' "$work/train.log" | awk '{print $3}' | tail -1)
single=$(bin/qvd train --data "$data" --out "$work/single" --micro-batch 64 "${job[@]}" 2>/dev/null | grep -o 'test accuracy [0-9.]*' | awk '{print $3}')
[ -n "$acc" ] && [ -n "$single" ] || fail "no accuracy (cluster '$acc', single '$single')"
awk -v a="$acc" -v b="$single" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 0.002) }' ||
  fail "cluster accuracy $acc, single process $single"
log "test accuracy $acc; one process with the same global batch: $single"
compose down -v >/dev/null 2>&1

# --- 2. partition one worker ----------------------------------------------------------------
log "scenario 2: cut worker2 (rank 2) off the network mid-training"
export QVD_RUN=part QVD_ARGS="--max-steps 100000 --epochs 100 --train-subset 6000 --test-subset 500 --checkpoint-every 20 --quiet"
compose up -d --no-build >/dev/null 2>&1
ckdir="$QVD_RUNS/part/checkpoints"
has_ckpt() { compgen -G "$ckdir/step-*" >/dev/null; }
for _ in $(seq 180); do
  has_ckpt && break
  sleep 1
done
has_ckpt || { compose logs --no-color | tail -30 >&2; fail "no checkpoint within 180 s"; }
sleep 2
victim=$(compose ps -q worker2)
docker network disconnect qvdtest_qvdnet "$victim"
cut=$SECONDS
codes=$(wait_exit 90 coordinator worker1 worker3)
took=$((SECONDS - cut))
compose logs --no-color > "$work/part.log" 2>&1
log "after the cut (${took} s): $(echo "$codes" | tr '\n' ' ')"
case "$codes" in *running*) fail "a node was still running 90 s after the partition" ;; esac
if echo "$codes" | awk '$2 == 0 {found = 1} END {exit !found}'; then fail "a node exited 0 although its peer was cut off"; fi
# (No grep -q in pipelines: under pipefail the writer's SIGPIPE would fail them.)
for s in coordinator worker1 worker3; do
  named=$(grep -E "^${s}_" "$work/part.log" | grep -E 'training failed' | grep -i 'rank 2' || true)
  [ -n "$named" ] || { grep -E "^${s}_" "$work/part.log" | grep -iE 'error|fail' | tail -5 >&2; fail "$s's error does not name rank 2"; }
done
log "the survivors failed naming rank 2: $(grep -E '^coordinator_' "$work/part.log" | grep 'training failed' | head -1 | sed 's/.*training failed: //' | cut -c1-160)"
compose kill >/dev/null 2>&1 || true
last=$(ls "$ckdir" | grep '^step-' | sort | tail -1)
step=$((10#${last#step-}))
if ! out=$(bin/qvd train --data "$data" --out "$work/resumed" --resume "$ckdir/$last" --micro-batch 64 --max-steps $((step + 5)) \
    --epochs 100 --train-subset 6000 --test-subset 500 --quiet 2>&1); then
  echo "$out" | tail -20 >&2
  fail "the last checkpoint ($last) does not resume"
fi
log "the last checkpoint, $last, verifies and one process resumed from it to step $((step + 5))"

# --- 3. shared IPC namespace: shared memory --------------------------------------------------
log "scenario 3: the workers share the coordinator's IPC namespace"
compose down -v >/dev/null 2>&1 || true
export QVD_RUN=shm QVD_ARGS="${job[*]}" QVD_IPC=shareable QVD_WORKER_IPC=service:coordinator
compose up -d --no-build >/dev/null 2>&1
codes=$(wait_exit 240 "${services[@]}")
compose logs --no-color > "$work/shm.log" 2>&1
log "finished: $(echo "$codes" | tr '\n' ' ')"
if echo "$codes" | awk '$2 != 0 {bad = 1} END {exit !bad}'; then
  tail -40 "$work/shm.log" >&2
  fail "a node did not exit 0 over shared memory"
fi
planned=$(grep -o '"data_plane": "[a-z]*"' "$work/shm.log" | sort | uniq -c)
[ "$(echo "$planned" | awk '{print $1, $3}')" = '4 "shm"' ] || fail "with a shared IPC namespace auto should choose shm on all 4 ranks: $planned"
hashes=$(grep -o '"weights_sha256": "[0-9a-f]*"' "$work/shm.log" | sort | uniq -c)
[ "$(echo "$hashes" | wc -l)" -eq 1 ] && [ "$(echo "$hashes" | awk '{print $1}')" -eq 4 ] && [ "$(echo "$hashes" | awk '{print $3}')" = "$tcp_hash" ] ||
  fail "over shared memory the weights differ from scenario 1's ($tcp_hash): $hashes"
log "auto chose shared memory; all 4 ranks end with scenario 1's weights, bit for bit"
compose down -v >/dev/null 2>&1 || true
unset QVD_IPC QVD_WORKER_IPC
log "PASS"
