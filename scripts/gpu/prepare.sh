#!/usr/bin/env bash
# Builds, on a machine with Go and the CUDA headers (scripts/setup.sh --cuda), everything
# scripts/gpu/run.sh needs on a GPU machine that has no Go: the cuda-tagged qvd and the test
# binaries of the CUDA backend and the NCCL communicator, stripped, under gpu-run/, plus a
# copy of Fashion-MNIST. Carry gpu-run/ (and the repository, for configs and bench/) there
# and run scripts/gpu/run.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=gpu-run
mkdir -p "$out/bin" "$out/data"
flags=(-trimpath -ldflags "-s -w")
go build -tags cuda "${flags[@]}" -o "$out/bin/qvd" ./cmd/qvd
go test -tags cuda -c "${flags[@]}" -o "$out/bin/gpu-cuda.test" ./gpu/cuda
go test -tags cuda -c "${flags[@]}" -o "$out/bin/nccl.test" ./collective/nccl
go test -c "${flags[@]}" -o "$out/bin/gpu.test" ./gpu
cp -u /usr/share/datasets/fashion-mnist/*.gz "$out/data/"
du -sh "$out"/bin/* "$out/data"
