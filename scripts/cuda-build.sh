#!/usr/bin/env bash
# Compiles the GPU build (build tag cuda): go vet over every package and test with the tag,
# the qvd binary (bin/qvd-cuda) and the test binaries of the CUDA backend and the NCCL
# communicator, which only run on a GPU machine (scripts/gpu/). Needs the CUDA headers
# (scripts/setup.sh --cuda); without them it says so and exits 0, unless QVD_REQUIRE_CUDA=1
# (CI), when that is a failure.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f /usr/include/cuda.h ]; then
  if [ "${QVD_REQUIRE_CUDA:-0}" = 1 ]; then
    echo "cuda-build: /usr/include/cuda.h is missing: run scripts/setup.sh --cuda" >&2
    exit 1
  fi
  echo "cuda-build: SKIPPED the -tags cuda build: no CUDA headers here (scripts/setup.sh --cuda installs them)"
  exit 0
fi
go vet -tags cuda ./...
go build -tags cuda -o bin/qvd-cuda ./cmd/qvd
go test -tags cuda -c -o /dev/null ./engine/cuda
go test -tags cuda -c -o /dev/null ./collective/nccl
echo "cuda-build: go vet -tags cuda ./... passed; built bin/qvd-cuda ($(du -h bin/qvd-cuda | cut -f1), links $(ldd bin/qvd-cuda | grep -o 'libcuda[^ ]*' | head -1) only) and the GPU test binaries"
