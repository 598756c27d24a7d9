#!/usr/bin/env bash
# Side-by-side all-reduce comparison on this machine, in one sitting: OpenMPI's MPI_Allreduce
# (TCP loopback and shared memory) against `qvd bench allreduce` (gRPC and TCP transports),
# interleaved so that load changes hit both alike. Prints the median busbw of ROUNDS runs.
#   apt-get install -y openmpi-bin libopenmpi-dev
#   bench/compare-allreduce.sh [SIZE] [ROUNDS]      (default 64MiB, 5 rounds; NPROC="2 4", ITERS=10)
set -euo pipefail
cd "$(dirname "$0")/.."
size=${1:-64MiB}
rounds=${2:-5}
[ -x bin/qvd ] || go build -o bin/qvd ./cmd/qvd
mpicc -O3 -march=native -o bin/mpi_allreduce bench/mpi_allreduce.c -lm
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
declare -A res
for np in ${NPROC:-2 4}; do
  for r in $(seq "$rounds"); do
    v=$(mpirun "${root[@]}" --oversubscribe -np "$np" --mca btl tcp,self --mca btl_tcp_if_include lo bin/mpi_allreduce --iters "${ITERS:-10}" "$size" | awk '!/^#/{print $4}')
    res["mpi-tcp,$np"]+="$v "
    v=$(mpirun "${root[@]}" --oversubscribe -np "$np" --mca btl vader,self bin/mpi_allreduce --iters "${ITERS:-10}" "$size" | awk '!/^#/{print $4}')
    res["mpi-shm,$np"]+="$v "
    for t in grpc tcp; do
      v=$(bin/qvd bench allreduce --nproc "$np" --transport "$t" --sizes "$size" --iters "${ITERS:-10}" 2>/dev/null | awk '/^\[rank 0\] +[0-9]/{print $6}')
      res["qvd-$t,$np"]+="$v "
    done
  done
done
median() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
printf "%-10s %6s %12s   %s\n" impl ranks "busbw(GB/s)" "all runs"
for k in $(printf "%s\n" "${!res[@]}" | sort -t, -k2n -k1); do
  printf "%-10s %6s %12s   %s\n" "${k%,*}" "${k#*,}" "$(echo "${res[$k]}" | median)" "${res[$k]}"
done
