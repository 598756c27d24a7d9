#!/usr/bin/env bash
# test.sh — qvd on a real SLURM: sets up a one-node SLURM on this machine (setup-local.sh),
# builds bin/qvd, submits scripts/slurm/qvd.sbatch with 2 and with 4 tasks, and checks that
# each job completes with the results of `qvd launch --nproc N` with the same flags: the same
# final checkpoint files (sha256 of model.safetensors and the optimizer shards: runs of the
# same N are bit-identical) and the same test accuracy. Prints PASS or FAIL per N; exits
# non-zero on any FAIL.
#
#   sudo scripts/slurm/test.sh             # TASKS="2 4" by default; KEEP=1 keeps the run dirs
#   sudo scripts/slurm/test.sh --teardown  # also stop the SLURM daemons afterwards
#
# Needs root (it installs and starts slurmctld, slurmd, munged), Go, and the Fashion-MNIST
# dataset (scripts/setup.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
repo=$PWD
teardown=0
[ "${1:-}" = --teardown ] && teardown=1
TASKS=${TASKS:-2 4}
GLOBAL_BATCH=64
ARGS=(-c configs/fashion-mlp.yaml --max-steps 30 --epochs 1 --train-subset 3072 --test-subset 512 --seed 5 --quiet)

t0=$(date +%s)
scripts/slurm/setup-local.sh
[ $teardown = 1 ] && trap 'scripts/slurm/teardown-local.sh' EXIT
t_setup=$(date +%s)

if [ -z "${QVD:-}" ]; then
	go build -o bin/qvd ./cmd/qvd
	QVD=$repo/bin/qvd
fi
echo "test: qvd $("$QVD" version)"
work=$(mktemp -d /tmp/qvd-slurm-test.XXXXXX)
[ "${KEEP:-0}" = 1 ] || trap 'rm -rf "$work"; [ $teardown = 1 ] && scripts/slurm/teardown-local.sh' EXIT
echo "test: work directory $work"

# The final checkpoint's files as "name sha256" lines.
digests() { # run dir
	local ck
	ck=$(ls -d "$1"/checkpoints/step-* 2>/dev/null | sort | tail -1)
	[ -n "$ck" ] || return 1
	(cd "$ck" && sha256sum -- *.safetensors | awk '{print $2, $1}')
	echo "step $(basename "$ck")"
}
accuracy() { grep -o 'test accuracy [0-9.]*' "$1" 2>/dev/null | tail -1; }

fail=0
for n in $TASKS; do
	micro=$((GLOBAL_BATCH / n))
	threads=$(($(nproc) / n))
	[ $threads -ge 1 ] || threads=1
	slurm_out=$work/slurm-$n
	launch_out=$work/launch-$n
	log=$work/slurm-$n.log

	# --overcommit: more tasks than this machine's cores. The environment (QVD, QVD_OUT, the
	# thread counts launch would choose) reaches the job through sbatch's --export=ALL.
	s=$(date +%s%N)
	job=$(QVD=$QVD QVD_OUT=$slurm_out GOMAXPROCS=$threads OPENBLAS_NUM_THREADS=$threads \
		sbatch --parsable --job-name=qvd-test-$n -n "$n" --overcommit --time=10 -o "$log" \
		scripts/slurm/qvd.sbatch "${ARGS[@]}" --micro-batch $micro) || true
	job=${job%%;*}
	# Poll rather than `sbatch --wait`, which checks only every 10 s.
	state=JobState=not-submitted exitc=ExitCode=?
	for _ in $(seq 1200); do
		[ -n "$job" ] || break
		info=$(scontrol show job "$job" 2>/dev/null || true)
		state=$(grep -o 'JobState=[A-Z_]*' <<<"$info" | head -1)
		exitc=$(grep -o ' ExitCode=[0-9:]*' <<<"$info" | head -1 | tr -d ' ')
		case $state in JobState=PENDING | JobState=RUNNING | JobState=CONFIGURING | JobState=COMPLETING | JobState=SUSPENDED | "") sleep 0.5 ;; *) break ;; esac
	done
	slurm_ms=$((($(date +%s%N) - s) / 1000000))

	s=$(date +%s%N)
	"$QVD" launch --nproc "$n" --out "$launch_out" "${ARGS[@]}" --micro-batch $micro >"$work/launch-$n.log" 2>&1 || echo "test: qvd launch --nproc $n failed (see $work/launch-$n.log)"
	launch_ms=$((($(date +%s%N) - s) / 1000000))

	echo "== $n tasks (micro-batch $micro): SLURM job $job $state $exitc in $((slurm_ms / 1000)).$((slurm_ms % 1000 / 100))s; qvd launch in $((launch_ms / 1000)).$((launch_ms % 1000 / 100))s"
	ok=1
	if [ "$state" != JobState=COMPLETED ] || [ "$exitc" != ExitCode=0:0 ]; then
		ok=0
		echo "-- SLURM job output ($log):"
		tail -40 "$log" 2>/dev/null || true
	fi
	a=$(digests "$slurm_out" 2>/dev/null || echo "no checkpoint")
	b=$(digests "$launch_out" 2>/dev/null || echo "no checkpoint")
	echo "   slurm : $(accuracy "$log" || echo "no accuracy")"
	echo "   launch: $(accuracy "$work/launch-$n.log" || echo "no accuracy")"
	join -a1 -a2 -e - -o 0,1.2,2.2 <(sort <<<"$a") <(sort <<<"$b") |
		awk '{printf "   %-28s slurm %-20.20s launch %.20s\n", $1, $2, $3}'
	if [ "$a" != "$b" ] || [ "$a" = "no checkpoint" ]; then
		ok=0
		echo "   final checkpoints differ"
	fi
	if [ "$(accuracy "$log")" != "$(accuracy "$work/launch-$n.log")" ] || [ -z "$(accuracy "$log")" ]; then
		ok=0
		echo "   test accuracies differ"
	fi
	# Ranks follow SLURM_PROCID: task i logs rank i.
	for ((i = 1; i < n; i++)); do
		grep -q "^ *$i: .*\"rank\": $i[,}]" "$log" 2>/dev/null || { ok=0; echo "   task $i did not run as rank $i"; }
	done
	if [ $ok = 1 ]; then echo "PASS $n tasks"; else echo "FAIL $n tasks"; fail=1; fi
done
t_end=$(date +%s)
echo "test: setup $((t_setup - t0))s, total $((t_end - t0))s"
[ $fail = 0 ] && echo PASS || echo FAIL
exit $fail
