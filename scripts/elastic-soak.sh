#!/usr/bin/env bash
# elastic-soak.sh: kill -9 random workers of an elastic launch, again and again, and check that
# the job heals and loses nothing.
#
# It builds qvd and runs `qvd launch --nproc 4 --min-nodes 2 --max-restarts 20` on the
# Fashion-MNIST MLP (global batch 96: micro-batch 8 × accum 3 at world 4, and the same at
# worlds 3 and 2, so elastic.keep_global_batch holds). While it trains, KILLS times it
# SIGKILLs one random worker — or two at once, never more — and waits, with a deadline, until
# the launcher has restarted them and metrics.jsonl records a re-form back to world 4 before
# the next kill. Then it checks:
#   1. the launch exits 0;
#   2. the final test accuracy (metrics.jsonl's last eval record) is ≥ MIN_ACCURACY;
#   3. metrics.jsonl holds a "reform" event for every kill at least;
#   4. no sample of an epoch was lost or trained twice: every training process logs its
#      micro-batches (QVD_SAMPLE_LOG) and scripts/samplecheck checks them.
# Every wait has a deadline and the launch runs under `timeout`: the soak cannot hang.
#
# Usage: scripts/elastic-soak.sh   (settings from the environment:)
#   KILLS=10 EPOCHS=15 SEED=$RANDOM MIN_ACCURACY=0.88 TIMEOUT=1200 WORK=$(mktemp -d)
#   PAIRS=1 (0: one worker at a time, never two at once)
#   EXTRA="--zero-stage 2 --checkpoint-every 200" (more train flags: at stages 1-2 the lost
#   shards come from the neighbour snapshots, or, when two neighbours die at once, a checkpoint)
#   DATA=/usr/share/datasets/fashion-mnist
# Exit 0: every check passed; 1: a check failed; 2: the soak could not run.
set -euo pipefail

KILLS=${KILLS:-10}
PAIRS=${PAIRS:-1}
EPOCHS=${EPOCHS:-15}
SEED=${SEED:-$RANDOM}
MIN_ACCURACY=${MIN_ACCURACY:-0.88}
TIMEOUT=${TIMEOUT:-1200}          # the whole launch, seconds
REJOIN_WAIT=${REJOIN_WAIT:-180}   # a kill → the re-form back to world 4, seconds
DATA=${DATA:-/usr/share/datasets/fashion-mnist}
NPROC=4 MIN_NODES=2 MAX_RESTARTS=20 MAX_DEAD=2
MICRO=8 ACCUM=3 TRAIN_SIZE=60000
GLOBAL=$((MICRO * ACCUM * NPROC))
STEPS=$((EPOCHS * (TRAIN_SIZE / GLOBAL)))
LAST_KILL_STEP=$((STEPS * 85 / 100)) # no kill after this: the job must still be running to heal

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${WORK:-$(mktemp -d /tmp/qvd-soak.XXXXXX)}
mkdir -p "$WORK/samples"
RUN=$WORK/run LOG=$WORK/launch.log METRICS=$WORK/run/metrics.jsonl
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
export QVD_SAMPLE_LOG=$WORK/samples
RANDOM=$SEED

say() { echo "soak: $*"; }
die() { say "FAIL: $*"; exit 1; }

say "work dir $WORK, seed $SEED, $KILLS kills, $EPOCHS epochs ($STEPS steps, global batch $GLOBAL)"
[[ -e $DATA/train-images-idx3-ubyte.gz ]] || { say "no Fashion-MNIST at $DATA (set DATA)"; exit 2; }
(cd "$ROOT" && timeout 600 go build -o "$WORK/qvd" ./cmd/qvd && timeout 600 go build -o "$WORK/samplecheck" ./scripts/samplecheck) ||
	{ say "build failed"; exit 2; }

# The launch runs in its own session, so that the exit trap can stop every process of it.
setsid timeout -k 30 "$TIMEOUT" "$WORK/qvd" launch --nproc $NPROC --min-nodes $MIN_NODES --max-restarts $MAX_RESTARTS \
	-c "$ROOT/configs/fashion-mlp.yaml" --data "$DATA" --out "$RUN" --epochs "$EPOCHS" \
	--micro-batch $MICRO --accum $ACCUM --transport tcp --quiet ${EXTRA:-} >"$LOG" 2>&1 &
TPID=$!
cleanup() {
	if kill -0 "$TPID" 2>/dev/null; then
		kill -TERM -- "-$TPID" 2>/dev/null || true
		sleep 5
		kill -KILL -- "-$TPID" 2>/dev/null || true
	fi
}
trap cleanup EXIT

running() { kill -0 "$TPID" 2>/dev/null; }
launcher() { pgrep -P "$TPID" | head -1; }
# worker_pid NAME: the pid of the launch's worker process named NAME, or nothing.
worker_pid() {
	local l p
	l=$(launcher) || return 0
	for p in $(pgrep -P "$l"); do
		if tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "--node-name $1 "; then
			echo "$p"
			return 0
		fi
	done
}
count() { grep -c -- "$1" "$2" 2>/dev/null || true; }
last_step() { tac "$METRICS" 2>/dev/null | grep -m1 '"kind":"train"' | sed 's/.*"step":\([0-9]*\).*/\1/' || true; }
# worlds_since N: the worlds of the re-form records after the first N.
worlds_since() { grep '"event":"reform"' "$METRICS" 2>/dev/null | tail -n +"$(($1 + 1))" | sed 's/.*"world":\([0-9]*\).*/\1/' || true; }

# Wait for training to be under way.
for ((i = 0; i < 1200; i++)); do
	running || break
	[[ $(last_step) -ge 20 ]] 2>/dev/null && break
	sleep 0.25
done
running || { tail -20 "$LOG"; die "the launch ended before training was under way"; }
[[ $(last_step) -ge 20 ]] 2>/dev/null || die "no training step 20 in 300 s"

killed=0
while ((killed < KILLS)); do
	sleep "$((1 + RANDOM % 4)).$((RANDOM % 10))"
	running || die "the launch ended after $killed of $KILLS kills"
	step=$(last_step)
	((step <= LAST_KILL_STEP)) || die "step $step of $STEPS reached after $killed of $KILLS kills: raise EPOCHS"
	n=1
	((PAIRS && KILLS - killed >= 2 && RANDOM % 4 == 0)) && n=$MAX_DEAD
	reforms=$(count '"event":"reform"' "$METRICS")
	restarts=$(count 'qvd launch: restarting rank' "$LOG")
	victims=()
	while ((${#victims[@]} < n)); do
		v=$((RANDOM % NPROC))
		[[ " ${victims[*]} " == *" $v "* ]] || victims+=("$v")
	done
	names=$(printf 'launch-00%s ' "${victims[@]}")
	for v in "${victims[@]}"; do
		pid=$(worker_pid "launch-00$v")
		[[ -n $pid ]] || die "no process of launch-00$v to kill (killed $killed)"
		kill -9 "$pid"
		killed=$((killed + 1))
		say "kill $killed: launch-00$v (pid $pid) at step $step"
	done
	# Wait for the restarts and for a re-form back to world 4 after this kill's.
	healed=
	for ((i = 0; i < REJOIN_WAIT * 4; i++)); do
		running || die "the launch ended while the job healed from kill $killed (${names% })"
		if (($(count 'qvd launch: restarting rank' "$LOG") >= restarts + n)) && worlds_since "$reforms" | grep -qx "$NPROC"; then
			healed=1
			break
		fi
		sleep 0.25
	done
	[[ -n $healed ]] || { tail -30 "$LOG"; die "the job did not re-form at world $NPROC within ${REJOIN_WAIT}s of kill $killed"; }
	say "  healed in $((i / 4)) s: re-forms since the kill at worlds $(worlds_since "$reforms" | tr '\n' ' ')at step $(last_step)"
done

say "all $killed kills done at step $(last_step); waiting for the job to finish"
code=0
wait "$TPID" || code=$?
trap - EXIT
tail -4 "$LOG"
fail=0
check() { if eval "$2"; then say "ok   $1"; else say "FAIL $1"; fail=1; fi; }
acc=$(grep '"kind":"eval"' "$METRICS" | tail -1 | sed 's/.*"accuracy":\([0-9.]*\).*/\1/')
reforms=$(count '"event":"reform"' "$METRICS")
restarted=$(count 'qvd launch: restarting rank' "$LOG")
check "launch exit code $code (want 0)" '((code == 0))'
check "final step $(last_step) (want $STEPS)" '[[ $(last_step) == "$STEPS" ]]'
check "test accuracy $acc (want ≥ $MIN_ACCURACY)" 'awk -v a="$acc" -v m="$MIN_ACCURACY" "BEGIN { exit !(a != \"\" && a >= m) }"'
check "$reforms re-form events in metrics.jsonl (want ≥ $killed kills)" '((reforms >= killed))'
check "$restarted restarts (want ≥ $killed kills)" '((restarted >= killed))'
# More restarts than kills: a worker died of something else (or another process killed it).
((restarted == killed)) || say "note: $((restarted - killed)) restarts of workers the soak did not kill; see $LOG"
if compgen -G "$WORK/samples/samples-*.jsonl" >/dev/null; then
	check "every sample of every epoch trained once:" \
		'"$WORK/samplecheck" -epochs "$EPOCHS" -global-batch $GLOBAL -train-size $TRAIN_SIZE "$WORK/samples"'
else
	say "FAIL no sample log in $WORK/samples: this qvd does not write QVD_SAMPLE_LOG"
	fail=1
fi
((fail == 0)) || die "see $LOG and $METRICS"
say "PASS ($killed kills, seed $SEED, work dir $WORK)"
