#!/usr/bin/env bash
# Builds bench/mpi_allreduce.c and runs OpenMPI's MPI_Allreduce over TCP loopback and over
# shared memory, for comparison with `qvd bench allreduce` on the same machine:
#   apt-get install -y openmpi-bin libopenmpi-dev
#   bench/run-mpi.sh [SIZES...]        (default 1MiB 4MiB 16MiB 64MiB 256MiB; NPROC=2,4)
set -euo pipefail
cd "$(dirname "$0")"
sizes=("${@:-1MiB 4MiB 16MiB 64MiB 256MiB}")
mkdir -p ../bin
mpicc -O3 -march=native -o ../bin/mpi_allreduce mpi_allreduce.c -lm
root=()
[ "$(id -u)" -eq 0 ] && root=(--allow-run-as-root)
for np in ${NPROC:-2 4}; do
  for btl in "tcp,self" "vader,self"; do
    echo "## OpenMPI $np ranks, btl $btl"
    extra=()
    [ "$btl" = "tcp,self" ] && extra=(--mca btl_tcp_if_include lo)
    mpirun "${root[@]}" --oversubscribe -np "$np" --mca btl "$btl" "${extra[@]}" \
      ../bin/mpi_allreduce --dtype "${DTYPE:-fp32}" ${sizes[@]}
  done
done
