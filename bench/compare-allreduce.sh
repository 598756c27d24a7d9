#!/usr/bin/env bash
# Side-by-side all-reduce comparison on this machine, in one sitting: OpenMPI's MPI_Allreduce
# (TCP loopback and shared memory), PyTorch's gloo (bench/gloo_allreduce.py) and `qvd bench
# allreduce` (shared-memory, TCP and gRPC data planes), interleaved so that load changes hit all
# alike. Prints the median busbw of ROUNDS runs. IMPLS picks a subset (default: all of
# "mpi-tcp mpi-shm gloo qvd-shm qvd-tcp qvd-grpc").
#   apt-get install -y openmpi-bin libopenmpi-dev python3-torch
#   bench/compare-allreduce.sh [SIZE] [ROUNDS]      (default 64MiB, 5 rounds; NPROC="2 4", ITERS=10)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-64MiB}
rounds=${2:-5}
go build -o bin/qvd ./cmd/qvd # always: an older bin/qvd prints another table
mpicc -O3 -march=native -o bin/mpi_allreduce bench/mpi_allreduce.c -lm
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
# busbw is the last column of OpenMPI's data lines (size … time algbw busbw) and the one before
# the last of qvd's (… in-place time algbw busbw #wrong: nccl-tests' columns, of which this takes
# the in-place ones, as mpi_allreduce runs MPI_IN_PLACE); the time is two before busbw. Taking
# the columns from the end keeps the two reports comparable though qvd's lines carry a rank
# prefix and more columns than OpenMPI's (an earlier version took qvd's algbw by position: the
# same figure at 2 ranks, 1.5× too low at 4). Each value is printed as busbw/time(ms), the time
# is checked against the busbw it implies, and qvd's #wrong must be 0.
#   busbw REGEX AFTER    AFTER: how many columns follow busbw (0 for OpenMPI, 1 for qvd)
busbw() {
  awk -v re="$1" -v after="$2" -v n="$np" '$0 ~ re {
    if (after > 0 && $NF != 0) { print "wrong-result"; exit 1 }
    bus = $(NF-after); alg = $(NF-after-1); t = $(NF-after-2) / 1e3
    if (alg <= 0 || (bus / alg - 2 * (n - 1) / n) ^ 2 > 1e-4) { print "bad-report"; exit 1 }
    printf "%s/%.1f\n", bus, t }'
}
impls=${IMPLS:-mpi-tcp mpi-shm gloo qvd-shm qvd-tcp qvd-grpc}
iters=${ITERS:-10}
# run IMPL NP: one run's busbw/time.
run() {
  case $1 in
  mpi-tcp) mpirun "${root[@]}" --oversubscribe -np "$2" --mca btl tcp,self --mca btl_tcp_if_include lo bin/mpi_allreduce --iters "$iters" "$size" | busbw '^ +[0-9]' 0 ;;
  mpi-shm) mpirun "${root[@]}" --oversubscribe -np "$2" --mca btl vader,self bin/mpi_allreduce --iters "$iters" "$size" | busbw '^ +[0-9]' 0 ;;
  gloo) /usr/bin/python3 bench/gloo_allreduce.py --nproc "$2" --iters "$iters" "$size" | busbw '^ +[0-9]' 0 ;;
  qvd-*) bin/qvd bench allreduce --nproc "$2" --transport "${1#qvd-}" --sizes "$size" --iters "$iters" 2>/dev/null | busbw '^\[rank 0\] +[0-9]' 1 ;;
  esac
}
declare -A res
for np in ${NPROC:-2 4}; do
  for r in $(seq "$rounds"); do
    for i in $impls; do
      res["$i,$np"]+="$(np=$np run "$i" "$np") "
    done
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
printf "%-10s %6s %12s %14s   %s\n" impl ranks "busbw(GB/s)" "time(ms)" "all runs (busbw/time)"
for k in $(printf "%s\n" "${!res[@]}" | sort -t, -k2n -k1); do
  printf "%-10s %6s %12s %14s   %s\n" "${k%,*}" "${k#*,}" \
    "$(echo "${res[$k]}" | tr ' ' '\n' | cut -d/ -f1 | median)" \
    "$(echo "${res[$k]}" | tr ' ' '\n' | grep / | cut -d/ -f2 | median)" "${res[$k]}"
done
