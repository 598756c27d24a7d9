#!/usr/bin/env bash
# Side-by-side CPU Adam step on this machine, in one sitting: bench/adamw.c (GCC with FMAs, and
# with -ffp-contract=off, which gives qvd's bits) against offload's BenchmarkAdamW and
# BenchmarkAdam (internal/vec's AVX2 kernels, and the plain Go loops under -tags purego), with
# the stream7 kernel as the memory bound. Everything runs on all cores (OMP_NUM_THREADS and
# GOMAXPROCS = nproc). The runs are interleaved round by round so that the memory bandwidth the
# host leaves this VM, which swings by 2x from minute to minute, hits all alike; besides the
# median Mparams/s of each, it prints the median over rounds of each one's ratio to the FMA
# build's AdamW (or Adam) of the same round.
#   bench/compare-adamw.sh [ROUNDS] [SIZE]      (default 7 rounds, 64M parameters)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-7}
size=${2:-64M}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
export OMP_PROC_BIND=${OMP_PROC_BIND:-true}
mkdir -p bin
flags=(-O3 -march=native -fno-math-errno -fopenmp)
gcc "${flags[@]}" -o bin/adamw-fma bench/adamw.c -lm
gcc "${flags[@]}" -ffp-contract=off -o bin/adamw-nofma bench/adamw.c -lm
go test -c -o bin/offload.test ./offload
go test -c -tags purego -o bin/offload-purego.test ./offload
echo "# gcc $(gcc -dumpfullversion) ${flags[*]}; $(go version); $OMP_NUM_THREADS threads; $size parameters"
declare -A res ratio
c() { bin/adamw-"$1" --kernel "$2" --steps 20 "$size" | awk '!/^#/{print $5}'; }
gobench() { bin/"$1" -test.run '^$' -test.bench "^Benchmark$2\$/^$size\$" -test.benchtime 20x | awk '/^Benchmark/{print $(NF-1)/1e6}'; }
for r in $(seq "$rounds"); do
  declare -A cur=()
  for k in adamw adam; do
    cur[c-fma-$k]=$(c fma $k)
    cur[c-nofma-$k]=$(c nofma $k)
  done
  cur[c-stream7]=$(c nofma stream7)
  cur[go-simd-adamw]=$(gobench offload.test AdamW)
  cur[go-simd-adam]=$(gobench offload.test Adam)
  cur[go-purego-adamw]=$(gobench offload-purego.test AdamW)
  line="round $r:"
  for k in "${!cur[@]}"; do
    res[$k]+="${cur[$k]} "
    base=${cur[c-fma-adamw]}
    [[ $k == *-adam ]] && base=${cur[c-fma-adam]}
    ratio[$k]+="$(awk -v a="${cur[$k]}" -v b="$base" 'BEGIN{printf "%.3f", a/b}') "
    line+=" $k=${cur[$k]}"
  done
  echo "$line"
  unset cur
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
printf "%-16s %10s %8s %9s   %s\n" impl "Mparams/s" "GB/s" "vs C FMA" "all runs (Mparams/s)"
for k in c-stream7 c-fma-adamw c-nofma-adamw go-simd-adamw go-purego-adamw c-fma-adam c-nofma-adam go-simd-adam; do
  m=$(echo "${res[$k]}" | median)
  printf "%-16s %10.0f %8.1f %9s   %s\n" "$k" "$m" "$(awk -v m="$m" 'BEGIN{print m*28/1000}')" \
    "$(echo "${ratio[$k]}" | median)" "${res[$k]}"
done
