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
#   3. shared IPC: the same job with the workers in the coordinator's IPC namespace; auto must
#      choose shared memory, and the weights must be bit-identical to scenario 1's (the same
#      ring, the same reduction order, another data plane).
#   4. elastic: a job of --nodes 2:4 loses worker2 mid-run (docker kill): the others re-form at
#      world 3 (a reform record in metrics.jsonl) and train on; `docker start worker2` runs its
#      `qvd join` again, the job re-forms at world 4 and finishes there, every rank exiting 0
#      with the same weights.
#   5. split: an elastic job (--nodes 1:4, ZeRO stage 1, so every rank writes its optimizer
#      shard into the shared checkpoints) has worker3 cut off the network. The majority (3 of
#      4, with rank 0) re-forms at world 3 from the last checkpoint and finishes; the isolated
#      worker stops with elastic's minority error, and writes nothing to disk after the cut
#      (its process's write_bytes in /proc stays the same; no checkpoint after the cut holds a
#      fourth shard). See docs/elastic.md.
#
#   scripts/compose-test.sh [SCENARIO...]   (needs docker, docker-compose and dataset-fashion-mnist)
# SCENARIO is train, partition, shm, elastic or split; the default is all of them, in that order.
# Exits 0 when all pass; prints what it checked. Leaves nothing running.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="/usr/local/go/bin:$PATH"

compose() { docker-compose -p qvdtest "$@"; }
all_scenarios=(train partition shm elastic split)
scenarios=("$@")
[ ${#scenarios[@]} -gt 0 ] || scenarios=("${all_scenarios[@]}")
for sc in "${scenarios[@]}"; do
  [[ " ${all_scenarios[*]} " == *" $sc "* ]] || { echo "compose-test: unknown scenario $sc (want: ${all_scenarios[*]})" >&2; exit 2; }
done
want() { [[ " ${scenarios[*]} " == *" $1 "* ]]; }
log() { echo "compose-test: $*"; }
fail() { echo "compose-test: FAIL: $*" >&2; exit 1; }

data=${QVD_DATA:-/usr/share/datasets/fashion-mnist}
[ -f "$data/train-images-idx3-ubyte.gz" ] || fail "Fashion-MNIST not found in $data (apt-get install dataset-fashion-mnist)"
work=$(mktemp -d /tmp/qvd-compose.XXXXXX)
cleanup() {
  compose down -v --remove-orphans >/dev/null 2>&1 || true
  # QVD_COMPOSE_KEEP=DIR keeps the runs and logs there, to look into a failure.
  if [ -n "${QVD_COMPOSE_KEEP:-}" ]; then mkdir -p "$QVD_COMPOSE_KEEP" && cp -r "$work"/. "$QVD_COMPOSE_KEEP"/ || true; fi
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
tcp_hash="" # scenario 1's weights, which scenario 3 must reproduce over shared memory
scenario_train() {
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
}

# --- 2. partition one worker ----------------------------------------------------------------
scenario_partition() {
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
compose down -v >/dev/null 2>&1 || true
}

# --- 3. shared IPC namespace: shared memory --------------------------------------------------
scenario_shm() {
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
[ "$(echo "$hashes" | wc -l)" -eq 1 ] && [ "$(echo "$hashes" | awk '{print $1}')" -eq 4 ] ||
  fail "over shared memory the ranks ended with different weights: $hashes"
if [ -n "$tcp_hash" ]; then
  [ "$(echo "$hashes" | awk '{print $3}')" = "$tcp_hash" ] || fail "over shared memory the weights differ from scenario 1's ($tcp_hash): $hashes"
  log "auto chose shared memory; all 4 ranks end with scenario 1's weights, bit for bit"
else
  log "auto chose shared memory; all 4 ranks end with the same weights (scenario 1 not run: not compared with TCP)"
fi
compose down -v >/dev/null 2>&1 || true
unset QVD_IPC QVD_WORKER_IPC
}

# --- helpers of the elastic scenarios: the run's metrics.jsonl, one JSON record a line ---------
# until_within SECONDS CMD...: runs CMD every second until it succeeds; 1 at the deadline.
until_within() {
  local deadline=$((SECONDS + $1)); shift
  until "$@"; do
    [ $SECONDS -lt $deadline ] || return 1
    sleep 1
  done
}
# field NAME: NAME's value in the record on stdin, quotes dropped ("" when absent).
# ("world" is not matched inside "old_world": the pattern starts at the key's quote.)
field() { { grep -o "\"$1\":[^,}]*" || true; } | head -1 | cut -d: -f2- | tr -d '"'; }
# train_steps FILE: how many train records FILE holds (0 before it exists).
train_steps() { { grep -c '"kind":"train"' "$1" 2>/dev/null || true; } | head -1 | awk '{n = $1 + 0} END {print n + 0}'; }
trained_at_least() { [ "$(train_steps "$2")" -ge "$1" ]; }
# reform_to WORLD FILE: the first re-form record of FILE to WORLD ranks ("" when none).
reform_to() { { grep '"event":"reform"' "$2" 2>/dev/null || true; } | { grep "\"world\":$1," || true; } | head -1; }
has_reform() { [ -n "$(reform_to "$1" "$2")" ]; }
# grown_or_ended FILE: the job re-formed at world 4, or its coordinator is gone.
grown_or_ended() { has_reform 4 "$1" || [ "$(docker inspect -f '{{.State.Running}}' "$(compose ps -q coordinator)")" != true ]; }
# steps_after RECORD FILE: the train records written after RECORD (a whole line of FILE).
steps_after() { awk -v r="$1" '$0 == r {on = 1; next} on && /"kind":"train"/ {n++} END {print n + 0}' "$2"; }
steps_after_at_least() { [ "$(steps_after "$2" "$3")" -ge "$1" ]; }
# summary RECORD: a re-form record in a few words.
summary() {
  echo "world $(field old_world <<<"$1") -> $(field world <<<"$1") at step $(field step <<<"$1"), from $(field source <<<"$1")," \
    "lost_steps $(field lost_steps <<<"$1" | grep . || echo 0), resume_seconds $(field resume_seconds <<<"$1" | cut -c1-5)"
}
# dump_fail MESSAGE: fails with the end of every container's log.
dump_fail() {
  compose logs --no-color 2>&1 | tail -40 >&2
  fail "$1"
}
# exits_ok CODES: every "service code" line of wait_exit's output says 0.
exits_ok() { echo "$1" | awk '$2 != 0 {bad = 1} END {exit bad}'; }
# write_bytes PID: the bytes the process has caused to be written to storage (proc(5) io),
# counted when it dirties the page cache, so a write shows at once.
write_bytes() { awk '$1 == "write_bytes:" {print $2; found = 1} END {exit !found}' "/proc/$1/io" 2>/dev/null; }

# --- 4. elastic: lose a worker, take it back --------------------------------------------------
scenario_elastic() {
  log "scenario 4: an elastic job (--nodes 2:4) loses worker2 (docker kill) and takes it back (docker start)"
  # Accumulation 3 keeps the global batch at 16 × 3 × 4 = 192 samples at world 3 (accum 4) and
  # back at 4 (elastic.keep_global_batch).
  export QVD_RUN=elastic QVD_ARGS="--nodes 2:4 --accum 3 --max-steps 3000 --epochs 100 --train-subset 6000 --test-subset 500 --seed 7 --quiet"
  local m="$QVD_RUNS/elastic/metrics.jsonl" start=$SECONDS at t rec3 rec4 codes hashes last st
  compose up -d --no-build >/dev/null 2>&1
  until_within 120 trained_at_least 300 "$m" || dump_fail "the elastic job did not reach step 300 within 120 s"
  at=$(grep '"kind":"train"' "$m" | tail -1 | field step)
  docker kill "$(compose ps -q worker2)" >/dev/null
  t=$SECONDS
  until_within 60 has_reform 3 "$m" || dump_fail "no re-form to world 3 within 60 s of killing worker2"
  rec3=$(reform_to 3 "$m")
  log "killed worker2 (metrics.jsonl at step $at); re-formed within $((SECONDS - t)) s: $(summary "$rec3")"
  until_within 60 steps_after_at_least 200 "$rec3" "$m" || dump_fail "training did not go on at world 3 (200 steps within 60 s)"
  log "training goes on at world 3: $(steps_after "$rec3" "$m") steps after the re-form"
  # docker start runs the container's command again: a new `qvd join coordinator:7946`, with
  # worker2's hostname and address.
  docker start "$(compose ps -q worker2)" >/dev/null
  t=$SECONDS
  until_within 90 grown_or_ended "$m"
  has_reform 4 "$m" ||
    dump_fail "worker2 was not taken back: no re-form to world 4 within 90 s of docker start (the job was at step $(train_steps "$m") of 3000)"
  rec4=$(reform_to 4 "$m")
  log "docker start worker2: re-formed within $((SECONDS - t)) s: $(summary "$rec4")"
  codes=$(wait_exit 180 "${services[@]}")
  compose logs --no-color > "$work/elastic.log" 2>&1
  log "finished in $((SECONDS - start)) s: $(echo "$codes" | tr '\n' ' ')"
  exits_ok "$codes" || { tail -40 "$work/elastic.log" >&2; fail "a node did not exit 0 after the job took worker2 back"; }
  last=$(grep '"kind":"train"' "$m" | tail -1 | field step)
  [ "$last" = 3000 ] || fail "the job's last recorded step is $last, not 3000"
  [ "$(grep -c '"event":"reform"' "$m")" -eq 2 ] || fail "want exactly 2 re-forms (4 -> 3 -> 4): $(grep '"event":"reform"' "$m" | cut -c1-200)"
  [ "$(steps_after "$rec4" "$m")" -gt 0 ] || fail "no step recorded at world 4 after taking worker2 back"
  hashes=$(grep -o '"weights_sha256": "[0-9a-f]*"' "$work/elastic.log" | sort | uniq -c)
  [ "$(echo "$hashes" | wc -l)" -eq 1 ] && [ "$(echo "$hashes" | awk '{print $1}')" -eq 4 ] ||
    fail "after taking worker2 back the ranks ended with different weights: $hashes"
  log "the job finished at step 3000 with 4 ranks, $(steps_after "$rec4" "$m") steps at world 4; all 4 end with the same weights"
  # qvd status RUN_DIR reads the re-forms back from the run directory.
  st=$(bin/qvd status "$QVD_RUNS/elastic") || fail "qvd status $QVD_RUNS/elastic failed: $st"
  case "$st" in *"world:      4 (generation 3: 2 re-forms"*) ;; *) fail "qvd status does not show world 4 after 2 re-forms:"$'\n'"$st" ;; esac
  log "qvd status RUN_DIR: $(echo "$st" | grep '^world:' | sed 's/  */ /g')"
  compose down -v >/dev/null 2>&1 || true
}

# --- 5. split: the isolated worker stops and writes nothing ------------------------------------
scenario_split() {
  log "scenario 5: an elastic job (--nodes 1:4, ZeRO stage 1) has worker3 cut off the network"
  export QVD_RUN=split QVD_ARGS="--nodes 1:4 --accum 3 --zero-stage 1 --checkpoint-every 100 --max-steps 2000 --epochs 100 --train-subset 6000 --test-subset 500 --seed 7 --quiet"
  local m="$QVD_RUNS/split/metrics.jsonl" ckdir="$QVD_RUNS/split/checkpoints" start=$SECONDS
  local victim pid before after t st rec codes log3 late first
  latest_ckpt() { ls "$ckdir" 2>/dev/null | grep -E '^step-[0-9]{8}$' | tail -1 || true; }
  compose up -d --no-build >/dev/null 2>&1
  # Every rank writes its own optimizer shard: worker3's writes are visible before the cut.
  until_within 120 eval 'compgen -G "$ckdir/step-*/optimizer-00003.safetensors" >/dev/null' ||
    dump_fail "no checkpoint with 4 optimizer shards within 120 s"
  # A save under way at the cut would let worker3 finish the shard it had begun, so the cut
  # comes just after a checkpoint commits: the next is 100 steps away.
  first=$(latest_ckpt)
  t=$SECONDS
  until [ "$(latest_ckpt)" != "$first" ] && [ -f "$ckdir/$(latest_ckpt)/optimizer-00003.safetensors" ]; do
    [ $((SECONDS - t)) -lt 60 ] || dump_fail "no checkpoint after $first within 60 s"
    sleep 0.05
  done
  victim=$(compose ps -q worker3)
  pid=$(docker inspect -f '{{.State.Pid}}' "$victim")
  before=$(write_bytes "$pid") || fail "cannot read /proc/$pid/io (worker3's process): the test needs the Docker engine on this machine, and root"
  [ "$before" -gt 0 ] || fail "worker3's process has written nothing (write_bytes 0), yet 4 ranks wrote checkpoint shards"
  touch "$work/cut"
  docker network disconnect qvdtest_qvdnet "$victim"
  t=$SECONDS
  # The kernel's count goes with the process: sample it until worker3 exits.
  after=$before
  while [ "$(docker inspect -f '{{.State.Running}}' "$victim")" = true ] && [ $((SECONDS - t)) -lt 90 ]; do
    after=$(write_bytes "$pid") || after=${after:-$before}
    [ "$after" = "$before" ] || break
    sleep 0.2
  done
  st=$(docker inspect -f '{{if .State.Running}}running{{else}}{{.State.ExitCode}}{{end}}' "$victim")
  [ "$after" = "$before" ] || dump_fail "the isolated worker3 wrote to disk after the cut: write_bytes $before -> $after"
  [ "$st" != running ] || dump_fail "the isolated worker3 still runs 90 s after the cut"
  [ "$st" != 0 ] || dump_fail "the isolated worker3 exited 0"
  log3=$(docker logs "$victim" 2>&1 | grep 'not a majority of the last generation' | tail -1 || true)
  [ -n "$log3" ] || { docker logs --tail 20 "$victim" >&2; fail "the isolated worker3 did not stop with elastic's minority error"; }
  log "the isolated worker3 stopped $((SECONDS - t)) s after the cut, exit $st, writing nothing (write_bytes $after): $(echo "$log3" | grep -o 'elastic: not a majority[^;"]*' | head -1)"
  until_within 60 has_reform 3 "$m" || dump_fail "the majority did not re-form at world 3 within 60 s of the cut"
  rec=$(reform_to 3 "$m")
  log "the majority re-formed: $(summary "$rec")"
  codes=$(wait_exit 180 coordinator worker1 worker2)
  log "the majority finished in $((SECONDS - start)) s: $(echo "$codes" | tr '\n' ' ')"
  exits_ok "$codes" || dump_fail "a node of the majority did not exit 0"
  [ "$(grep '"kind":"train"' "$m" | tail -1 | field step)" = 2000 ] || fail "the majority did not reach step 2000"
  # What a straggler of the isolated side might still have written: a fourth shard after the cut.
  late=$(find "$ckdir" -newer "$work/cut" -name 'optimizer-0000[3-9].safetensors' | head -3)
  [ -z "$late" ] || fail "a fourth optimizer shard was written after the cut: $late"
  [ -n "$(find "$ckdir" -newer "$work/cut" -name 'optimizer-00002.safetensors' | head -1)" ] ||
    fail "the majority committed no checkpoint after the cut"
  log "checkpoints after the cut hold 3 shards only: $(ls "$ckdir" | grep '^step-' | tail -1)"
  compose down -v >/dev/null 2>&1 || true
}

for sc in "${all_scenarios[@]}"; do
  if want "$sc"; then "scenario_$sc"; fi
done
log "PASS: ${scenarios[*]}"
