#!/usr/bin/env bash
# Installs what qvd needs on a Debian/Ubuntu machine and builds bin/qvd.
#   - libopenblas-dev: the BLAS gorgonia's matrix products run on (cgo build)
#   - dataset-fashion-mnist: the real Fashion-MNIST in IDX format under /usr/share/datasets/fashion-mnist
# Go (>= 1.26) must be on PATH; modules come from the Go module proxy.
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(libopenblas-dev dataset-fashion-mnist gcc)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
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
