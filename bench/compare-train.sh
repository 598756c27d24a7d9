#!/usr/bin/env bash
# Interleaved CPU training-throughput comparison of qvd and PyTorch (bench/torch_train.py) on
# this machine, in one sitting, on the same cores: same models, batch, optimizer and data.
#
#   bench/compare-train.sh [--rounds R] [--steps S] [--warm W] CASE...
#
# CASEs:
#   mlp       qvd train -c configs/fashion-mlp.yaml           vs torch_train.py --model mlp
#   cnn       qvd train -c configs/fashion-cnn.yaml           vs torch_train.py --model cnn
#   mlp-big   the MLP config with hidden [4096, 4096, 4096]   vs torch_train.py --model mlp-big
#   vit       qvd train -c configs/fashion-vit.yaml           vs torch_train.py --model vit --hflip
#   ddp4      qvd launch --nproc 4 ... fashion-mlp --micro-batch 16  vs torch_train.py --world 4 --batch 16
#   ddp4-cnn  the same with the CNN
#
# Each round runs every case once, qvd and torch back to back, alternating which goes first
# from round to round, so the load swings of a noisy machine hit both alike. A run trains W
# warm-up steps (untimed; default 20) and then S timed steps (default per case: mlp 8000,
# cnn 1500, mlp-big 40, vit 250, ddp4 2500, ddp4-cnn 200; each run ~10-40 s here). A run's
# figure is the median over its timed steps of the per-step global samples/s: for qvd the
# samples_per_sec of rank 0's metrics.jsonl (the step's wall time from its start to the
# optimizer's end, batch filling included), for torch the same from time.perf_counter around
# each whole step. The table gives, per case, the median over rounds of the run figures with
# their min-max, the ratio of the medians, and the same ratio for the runs' means (total
# samples / total step time).
#
# Threads: qvd gets --threads $(nproc) (under launch, nproc/4 per rank, at least 1); torch gets
# torch.set_num_threads with the same count. Debian's PyTorch runs its matrix products in a
# separate OpenBLAS pool: for mlp and cnn (small matrices) torch runs it with one thread
# (--blas-threads 1), which was faster on the 2-core development machine than 2 OpenMP + 2
# OpenBLAS threads spinning against each other (it uses all of them for mlp-big). Override with
# TORCH_ARGS="--blas-threads N" (later arguments win). vit: --blas-threads 1 too, tried once
# each on the development machine (2026-11-24, 200 steps): 1 thread 679 samples/s, 2 threads
# 450. The ViT config flips the training images (augment: {hflip: true}): qvd runs the config
# as shipped and torch gets the same flip (--hflip: each sample mirrored with probability 1/2,
# drawn per step, a torch.where over the batch), so both pay for the same augmentation.
# torch_train.py also sets GLIBC_TUNABLES so that glibc reuses freed memory rather than mapping
# it afresh for every step's temporaries (3-4x faster steps on the development VM);
# TORCH_ARGS="--malloc default" measures it without.
#
# Environment: QVD (default bin/qvd; build it with `go build -o bin/qvd ./cmd/qvd`),
# PY (default /usr/bin/python3, the Python that has Debian's PyTorch), QVD_ARGS / TORCH_ARGS
# (extra arguments for every qvd / torch run), TIMEOUT (seconds per run, default 900),
# KEEP=1 keeps the temporary run directories.
# Exits non-zero (printing the failing run's log) as soon as any run fails.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit "${1:-0}"; }
rounds=3 steps="" warm=20
cases=()
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --warm) warm=$2; shift 2 ;;
    -h|--help) usage 0 ;;
    -*) echo "unknown flag $1" >&2; usage 2 ;;
    *) cases+=("$1"); shift ;;
  esac
done
((${#cases[@]})) || { echo "no CASE given" >&2; usage 2; }
[[ $rounds =~ ^[1-9][0-9]*$ && $warm =~ ^[0-9]+$ && ( -z $steps || $steps =~ ^[1-9][0-9]*$ ) ]] ||
  { echo "--rounds and --steps must be positive integers, --warm >= 0" >&2; exit 2; }

QVD=${QVD:-bin/qvd}
PY=${PY:-/usr/bin/python3}
TIMEOUT=${TIMEOUT:-900}
read -r -a qvd_extra <<<"${QVD_ARGS:-}"
read -r -a torch_extra <<<"${TORCH_ARGS:-}"
[ -x "$QVD" ] || { echo "no qvd binary at $QVD: build it (go build -o bin/qvd ./cmd/qvd) or set QVD=" >&2; exit 2; }
"$PY" -c 'import torch' 2>/dev/null || { echo "$PY cannot import torch (apt-get install python3-torch)" >&2; exit 2; }
ncpu=$(nproc)
ddp_threads=$(( ncpu / 4 > 0 ? ncpu / 4 : 1 ))

tmp=$(mktemp -d /tmp/compare-train.XXXXXX)
cleanup() { if [ "${KEEP:-0}" = 1 ]; then echo "# kept $tmp"; else rm -rf "$tmp"; fi; }
trap cleanup EXIT

# The MLP config with three 4096-wide hidden layers (36.8M parameters).
sed 's/^\(  hidden: \)\[256, 128\]$/\1[4096, 4096, 4096]/; s/^\(  name: \)fashion-mlp$/\1fashion-mlp-big/' \
  configs/fashion-mlp.yaml >"$tmp/fashion-mlp-big.yaml"
grep -q '^  hidden: \[4096, 4096, 4096\]$' "$tmp/fashion-mlp-big.yaml" ||
  { echo "could not derive the mlp-big config from configs/fashion-mlp.yaml" >&2; exit 1; }

# Per case: the qvd command (without --max-steps and --out), the torch command (without
# --steps/--warmup) and the default timed steps.
declare -A qcmd tcmd dsteps
common=(--quiet --checkpoint-every 0 --test-subset 1000)
for c in "${cases[@]}"; do
  case $c in
    mlp) qcmd[$c]="$QVD train -c configs/fashion-mlp.yaml --threads $ncpu"
         tcmd[$c]="$PY bench/torch_train.py --model mlp --batch 64 --threads $ncpu --blas-threads 1"; dsteps[$c]=8000 ;;
    cnn) qcmd[$c]="$QVD train -c configs/fashion-cnn.yaml --threads $ncpu"
         tcmd[$c]="$PY bench/torch_train.py --model cnn --batch 64 --threads $ncpu --blas-threads 1"; dsteps[$c]=1500 ;;
    mlp-big) qcmd[$c]="$QVD train -c $tmp/fashion-mlp-big.yaml --threads $ncpu"
         tcmd[$c]="$PY bench/torch_train.py --model mlp-big --batch 64 --threads $ncpu"; dsteps[$c]=40 ;;
    vit) qcmd[$c]="$QVD train -c configs/fashion-vit.yaml --threads $ncpu"
         tcmd[$c]="$PY bench/torch_train.py --model vit --hflip --batch 64 --threads $ncpu --blas-threads 1"; dsteps[$c]=250 ;;
    ddp4) qcmd[$c]="$QVD launch --nproc 4 -c configs/fashion-mlp.yaml --micro-batch 16 --threads $ddp_threads"
         tcmd[$c]="$PY bench/torch_train.py --model mlp --world 4 --batch 16 --threads $ddp_threads"; dsteps[$c]=2500 ;;
    ddp4-cnn) qcmd[$c]="$QVD launch --nproc 4 -c configs/fashion-cnn.yaml --micro-batch 16 --threads $ddp_threads"
         tcmd[$c]="$PY bench/torch_train.py --model cnn --world 4 --batch 16 --threads $ddp_threads"; dsteps[$c]=200 ;;
    *) echo "unknown case $c (want mlp, cnn, mlp-big, vit, ddp4, ddp4-cnn)" >&2; exit 2 ;;
  esac
done

commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
[ -z "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] || commit+=" (+ uncommitted changes)"
echo "# $(date -u '+%Y-%m-%d %H:%M:%S UTC'); $(lscpu | sed -n 's/^Model name: *//p' | head -1), nproc $ncpu"
# The commit the binary was built from, when go build embedded it (a build in a git checkout).
qvd_rev=$(go version -m "$QVD" 2>/dev/null | awk '$2 == "vcs.revision" {r = substr($3, 1, 7)} $2 == "vcs.modified" && $3 == "true" {m = "+modified"} END {print r m}' || true)
echo "# git $commit; $("$QVD" version 2>&1 | head -1) ($QVD, built $(date -u -r "$QVD" '+%Y-%m-%d %H:%M UTC')${qvd_rev:+ from $qvd_rev})"
echo "# torch $("$PY" -c 'import torch; print(torch.__version__)') ($PY); $(go version 2>/dev/null || echo 'go: not on PATH')"
echo "# $rounds rounds, $warm warm-up steps per run (untimed); commands (OUT: a fresh directory per run):"
for c in "${cases[@]}"; do
  s=${steps:-${dsteps[$c]}}
  echo "#   $c qvd:   ${qcmd[$c]} ${common[*]} ${qvd_extra[*]} --max-steps $((s + warm)) --out OUT"
  echo "#   $c torch: ${tcmd[$c]} --warmup $warm --steps $s ${torch_extra[*]}"
done

fail() { # fail LOG MESSAGE
  echo "FAILED: $2" >&2
  echo "--- last lines of $1:" >&2
  tail -n 30 "$1" >&2
  exit 1
}

# run_qvd CASE STEPS: prints "median mean" of the per-step samples/s after the warm-up steps.
run_qvd() {
  local c=$1 s=$2 out=$tmp/run log=$tmp/qvd.log
  rm -rf "$out"
  # shellcheck disable=SC2086 # qcmd holds a word-split command line
  timeout "$TIMEOUT" ${qcmd[$c]} "${common[@]}" "${qvd_extra[@]}" --max-steps $((s + warm)) --out "$out" \
    >"$log" 2>&1 || fail "$log" "$c: qvd exited with status $?"
  "$PY" - "$out/metrics.jsonl" "$warm" "$s" 2>>"$log" <<'EOF' || fail "$log" "$c: reading qvd's metrics"
import json, statistics, sys
path, warm, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
recs = [json.loads(l) for l in open(path) if l.strip()]
r = [x["samples_per_sec"] for x in recs if x.get("kind") == "train" and x["step"] > warm]
if len(r) != steps:
    sys.exit(f"{path}: {len(r)} timed train records, want {steps}")
print(statistics.median(r), len(r) / sum(1 / v for v in r))
EOF
}

# run_torch CASE STEPS: prints "median mean" from torch_train.py's JSON line.
run_torch() {
  local c=$1 s=$2 log=$tmp/torch.log
  # shellcheck disable=SC2086
  timeout "$TIMEOUT" ${tcmd[$c]} --warmup "$warm" --steps "$s" "${torch_extra[@]}" >"$log" 2>&1 ||
    fail "$log" "$c: torch exited with status $?"
  "$PY" -c '
import json, sys
d = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")][-1]
print(d["samples_per_sec_median"], d["samples_per_sec_mean"])' "$log" 2>>"$log" || fail "$log" "$c: no JSON line from torch"
}

declare -A med mean
for r in $(seq "$rounds"); do
  order=(qvd torch)
  ((r % 2)) || order=(torch qvd)
  for c in "${cases[@]}"; do
    s=${steps:-${dsteps[$c]}}
    for impl in "${order[@]}"; do
      t0=$SECONDS
      res=$(run_"$impl" "$c" "$s")   # a failed run exits the script (set -e)
      read -r m a <<<"$res"
      med[$c,$impl]+="$m " mean[$c,$impl]+="$a "
      printf "round %d %-8s %-5s median %9.1f samples/s  mean %9.1f  (%d s)\n" "$r" "$c" "$impl" "$m" "$a" \
        $((SECONDS - t0))
    done
  done
done

# stats VALUES: "median min max" of a space-separated list.
stats() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {printf "%s %s %s\n", (NR%2 ? a[(NR+1)/2] : (a[NR/2]+a[NR/2+1])/2), a[1], a[NR]}'; }
echo
echo "samples/s per step (global batch / step time): median over $rounds rounds of each run's median [min-max of the runs]"
printf "%-9s %6s %10s %19s %10s %19s %10s %12s\n" case steps qvd "[min-max]" torch "[min-max]" qvd/torch "(means)"
for c in "${cases[@]}"; do
  read -r qm qlo qhi < <(echo "${med[$c,qvd]}" | stats)
  read -r tm tlo thi < <(echo "${med[$c,torch]}" | stats)
  read -r qa _ _ < <(echo "${mean[$c,qvd]}" | stats)
  read -r ta _ _ < <(echo "${mean[$c,torch]}" | stats)
  printf "%-9s %6d %10.0f %19s %10.0f %19s %10.2f %12.2f\n" "$c" "${steps:-${dsteps[$c]}}" "$qm" \
    "[$(printf '%.0f-%.0f' "$qlo" "$qhi")]" "$tm" "[$(printf '%.0f-%.0f' "$tlo" "$thi")]" \
    "$(awk -v a="$qm" -v b="$tm" 'BEGIN{print a/b}')" "$(awk -v a="$qa" -v b="$ta" 'BEGIN{print a/b}')"
done
echo "(qvd/torch > 1: qvd is faster; (means): the same ratio for total samples / total step time, median over rounds)"
