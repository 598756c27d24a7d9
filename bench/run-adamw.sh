#!/usr/bin/env bash
# Builds bench/adamw.c, the C reference for qvd's CPU Adam step, twice — with GCC's default
# floating-point contraction (FMAs) and with -ffp-contract=off (qvd's rounding, bit for bit) —
# and runs both, followed by the streaming kernels that bound the step by memory bandwidth:
#   bench/run-adamw.sh [ROUNDS] [SIZE...]      (default 1 round, 16M 64M; OMP_NUM_THREADS=nproc)
# Each round runs every build once; with ROUNDS > 1 the script prints the median Mparams/s
# and GB/s of each kernel, build and size after the individual runs.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-1}
shift || true
sizes=("${@:-16M 64M}")
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
export OMP_PROC_BIND=${OMP_PROC_BIND:-true}
mkdir -p bin
flags=(-O3 -march=native -fno-math-errno -fopenmp)
gcc "${flags[@]}" -o bin/adamw-fma bench/adamw.c -lm
gcc "${flags[@]}" -ffp-contract=off -o bin/adamw-nofma bench/adamw.c -lm
echo "# gcc $(gcc -dumpfullversion) ${flags[*]} [-ffp-contract=off], OMP_NUM_THREADS=$OMP_NUM_THREADS"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq "$rounds"); do
  for b in fma nofma; do
    kernels=(adamw adam)
    # The streaming kernels do no arithmetic to contract: one build measures them.
    [ "$b" = nofma ] && kernels+=(stream7 triad)
    for k in "${kernels[@]}"; do
      bin/adamw-$b --kernel "$k" ${sizes[@]} | grep -v '^#' | sed "s/^/$b /" | tee -a "$out"
    done
  done
done
if [ "$rounds" -gt 1 ]; then
  echo "# medians of $rounds rounds: build kernel size Mparams/s GB/s"
  median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
  awk '{print $1, $2, $3}' "$out" | sort -u | while read -r b k s; do
    sel() { awk -v b="$b" -v k="$k" -v s="$s" -v f="$1" '$1==b && $2==k && $3==s {print $f}' "$out"; }
    echo "$b $k $s $(sel 6 | median) $(sel 7 | median)"
  done
fi
