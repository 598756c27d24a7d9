#!/usr/bin/env bash
# Builds, on a machine with Go and the CUDA headers (scripts/setup.sh --cuda), everything
# scripts/gpu/run.sh needs on a GPU machine that has no Go: the cuda-tagged qvd and the test
# binaries of the CUDA backend and the NCCL communicator, stripped, under gpu-run/bin (~34
# MiB), plus a copy of Fashion-MNIST in gpu-run/data (~30 MiB). Carry gpu-run/ (and the
# repository, for configs and bench/) there and run scripts/gpu/run.sh. Through this
# workplace's device tool, whose carry is limited to 64 MiB a call, carry the two folders in
# two calls to the same warm machine:
#   run(command="true", carry=["gpu-run/data"])
#   run(command="scripts/gpu/run.sh all", carry=["gpu-run/bin"])
set -euo pipefail
cd "$(dirname "$0")/../.."
out=gpu-run
mkdir -p "$out/bin" "$out/data"
flags=(-trimpath -ldflags "-s -w")
go build -tags cuda "${flags[@]}" -o "$out/bin/qvd" ./cmd/qvd
go test -tags cuda -c "${flags[@]}" -o "$out/bin/gpu-cuda.test" ./engine/cuda
go test -tags cuda -c "${flags[@]}" -o "$out/bin/nccl.test" ./collective/nccl
cp -u /usr/share/datasets/fashion-mnist/*.gz "$out/data/"
du -sh "$out"/bin/* "$out/data"
