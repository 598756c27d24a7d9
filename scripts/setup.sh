#!/usr/bin/env bash
# Installs what qvd needs on a Debian/Ubuntu machine and builds bin/qvd.
#   - libopenblas-dev: the BLAS gorgonia's matrix products run on (cgo build)
#   - dataset-fashion-mnist: the real Fashion-MNIST in IDX format under /usr/share/datasets/fashion-mnist
#   with --cuda also nvidia-cuda-dev (CUDA 11.8 headers, from Debian's non-free component,
#   which this enables): what `go build -tags cuda` (the GPU engine) compiles against
# Go (>= 1.26) must be on PATH; modules come from the Go module proxy.
set -euo pipefail
cd "$(dirname "$0")/.."
cuda=0
[ "${1:-}" = "--cuda" ] && cuda=1
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"

if ((cuda)) && ! dpkg-query -W -f='${Status}' nvidia-cuda-dev 2>/dev/null | grep -q "install ok installed"; then
  # Debian keeps the CUDA toolkit in non-free; enable contrib and non-free where the
  # deb822 sources file lists only main.
  src=/etc/apt/sources.list.d/debian.sources
  if [ -f "$src" ] && grep -q '^Components: main$' "$src"; then
    $sudo sed -i 's/^Components: main$/Components: main contrib non-free/' "$src"
  fi
  echo "setup: installing nvidia-cuda-dev (CUDA headers for -tags cuda; about 2.8 GB)"
  $sudo apt-get update -qq
  # --no-install-recommends: the recommended driver packages would build a kernel module.
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends nvidia-cuda-dev
fi

pkgs=(libopenblas-dev dataset-fashion-mnist gcc)
# --cuda (what CI runs) also installs prometheus, for the end-to-end test of --metrics-addr,
# and chromium, whose headless mode loads `qvd dashboard`'s page in internal/dashboard's test.
# g++ compiles the emulated CUDA driver's kernels (scripts/gpu/emulate.sh, internal/cudaemu);
# python3-torch is the other side of the PyTorch weight round trips (cmd/qvd TestTorchInterop).
if ((cuda)); then pkgs+=(prometheus chromium g++ python3-torch); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y --no-install-recommends "${missing[@]}" \
    || { $sudo apt-get update && $sudo apt-get install -y --no-install-recommends "${missing[@]}"; }
fi

if ! command -v go >/dev/null 2>&1; then
  [ -x /usr/local/go/bin/go ] && export PATH="/usr/local/go/bin:$PATH" || { echo "setup: Go is not installed (https://go.dev/dl/)"; exit 1; }
fi
go mod download
go build -o bin/qvd ./cmd/qvd
echo "setup: built bin/qvd ($(bin/qvd version))"
