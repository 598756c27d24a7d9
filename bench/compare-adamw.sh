#!/usr/bin/env bash
# Side-by-side CPU Adam step on this machine, in one sitting: bench/adamw.c (GCC with FMAs, and
# with -ffp-contract=off, which gives qvd's bits; the latter also with --hugepage, its buffers
# mapped as internal/arena maps qvd's) against optim's BenchmarkAdamW and BenchmarkAdam
# (internal/vec's AVX2 kernels, and the plain Go loops under -tags purego), with the stream7
# kernel as the memory bound. The Go figures are the pg=arena sub-benchmarks (state, parameters
# and gradients all in internal/arena blocks, as in the trainer); go-simd-adamw-pgheap is
# BenchmarkAdamW with the parameters and gradients on the Go heap instead. Everything runs on
# all cores (OMP_NUM_THREADS and GOMAXPROCS = nproc). The runs are interleaved round by round
# so that the memory bandwidth the host leaves this VM, which swings by 2x from minute to
# minute, hits all alike; besides the median Mparams/s of each, it prints the median (and the
# range) over rounds of each one's ratio to the FMA build's AdamW (or Adam) of the same round.
#   bench/compare-adamw.sh [ROUNDS] [SIZE] [IMPL...]   (default 7 rounds, 64M parameters, all)
# Naming a few IMPLs (c-fma-adamw is always run: it is the base) makes the rounds shorter, and
# the runs of one round closer in time. With WAIT_IDLE=1 each run first waits (a minute at
# most) until nothing else has been runnable for 2 s, so that another job's compiles on a
# shared 2-core VM do not land in some runs and not in others.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-7}
size=${2:-64M}
all=(c-stream7 c-fma-adamw c-nofma-adamw c-nofma-adamw-huge go-simd-adamw go-simd-adamw-pgheap
  go-purego-adamw c-fma-adam c-nofma-adam go-simd-adam)
impls=("${@:3}")
[ ${#impls[@]} -eq 0 ] && impls=("${all[@]}")
[[ " ${impls[*]} " == *" c-fma-adamw "* ]] || impls=(c-fma-adamw "${impls[@]}")
[[ " ${impls[*]} " == *"-adam "* && " ${impls[*]} " != *" c-fma-adam "* ]] && impls+=(c-fma-adam)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
export OMP_PROC_BIND=${OMP_PROC_BIND:-true}
mkdir -p bin
flags=(-O3 -march=native -fno-math-errno -fopenmp)
gcc "${flags[@]}" -o bin/adamw-fma bench/adamw.c -lm
gcc "${flags[@]}" -ffp-contract=off -o bin/adamw-nofma bench/adamw.c -lm
go test -c -o bin/optim.test ./optim
go test -c -tags purego -o bin/optim-purego.test ./optim
echo "# gcc $(gcc -dumpfullversion) ${flags[*]}; $(go version); $OMP_NUM_THREADS threads; $size parameters"
declare -A res ratio
c() { bin/adamw-"$1" --kernel "$2" --steps 20 "${@:3}" "$size" | awk '!/^#/{print $5}'; }
gobench() { bin/"$1" -test.run '^$' -test.bench "^Benchmark$2\$/^$size\$/^pg=${3:-arena}\$" -test.benchtime 20x | awk '/^Benchmark/{print $(NF-1)/1e6}'; }
idle() {
  [ "${WAIT_IDLE:-0}" = 1 ] || return 0
  local quiet=0 tries=0 running
  while [ $quiet -lt 10 ] && [ $tries -lt 300 ]; do
    running=$(cut -d' ' -f4 /proc/loadavg)
    if [ "${running%/*}" -le 1 ]; then quiet=$((quiet + 1)); else quiet=0; fi
    sleep 0.2
    tries=$((tries + 1))
  done
}
run() {
  idle
  case $1 in
    c-stream7) c nofma stream7 ;;
    c-fma-adamw) c fma adamw ;;
    c-nofma-adamw) c nofma adamw ;;
    c-nofma-adamw-huge) c nofma adamw --hugepage ;;
    c-fma-adam) c fma adam ;;
    c-nofma-adam) c nofma adam ;;
    go-simd-adamw) gobench optim.test AdamW ;;
    go-simd-adamw-pgheap) gobench optim.test AdamW heap ;;
    go-purego-adamw) gobench optim-purego.test AdamW ;;
    go-simd-adam) gobench optim.test Adam ;;
    *) echo "unknown implementation $1; known: ${all[*]}" >&2; exit 2 ;;
  esac
}
for r in $(seq "$rounds"); do
  declare -A cur=()
  for k in "${impls[@]}"; do
    cur[$k]=$(run "$k")
  done
  line="round $r (load $(cut -d' ' -f1 /proc/loadavg)):"
  for k in "${impls[@]}"; do
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
range() { tr ' ' '\n' | grep -v '^$' | sort -g | awk 'NR==1{lo=$1} {hi=$1} END {print lo "-" hi}'; }
printf "%-20s %10s %8s %9s %12s   %s\n" impl "Mparams/s" "GB/s" "vs C FMA" "(range)" "all runs (Mparams/s)"
for k in "${all[@]}"; do
  [ -n "${res[$k]:-}" ] || continue
  m=$(echo "${res[$k]}" | median)
  printf "%-20s %10.0f %8.1f %9s %12s   %s\n" "$k" "$m" "$(awk -v m="$m" 'BEGIN{print m*28/1000}')" \
    "$(echo "${ratio[$k]}" | median)" "$(echo "${ratio[$k]}" | range)" "${res[$k]}"
done
