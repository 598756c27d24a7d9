#!/bin/sh
# Regenerates kernels.ptx from kernels.cu: `go generate ./engine/cuda/kernels` (needs nvcc).
# compute_80 is the oldest virtual architecture with bfloat16 arithmetic; the driver JIT-compiles
# the PTX for the GPU it runs on (sm_90 on an H100). The first line records the source's
# sha256, so a test can tell, without nvcc, that kernels.ptx was made from this kernels.cu.
set -eu
cd "$(dirname "$0")"
sum=$(sha256sum kernels.cu | cut -d' ' -f1)
tmp=$(mktemp kernels.ptx.XXXXXX)
trap 'rm -f "$tmp"' EXIT
nvcc -ptx -arch=compute_80 -O3 -o "$tmp" kernels.cu
{ printf '// qvd-source-sha256: %s\n' "$sum"; cat "$tmp"; } >kernels.ptx
