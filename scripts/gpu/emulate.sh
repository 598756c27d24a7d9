#!/usr/bin/env bash
# Runs the GPU build (-tags cuda) on the CPU through the emulated CUDA driver and cuBLAS
# (internal/cudaemu): builds them into build/cudaemu, checks that they define every driver
# entry point bin/qvd-cuda links, runs engine/cuda's tests (the CUDA device against the
# reference device, and the emulator's planted bugs) with and without -race, checks that every
# kernel ran, and trains the MLP on --device cuda against --device reference for a few
# hundred steps. Needs the CUDA headers and OpenBLAS (scripts/setup.sh --cuda).
#   scripts/gpu/emulate.sh [quick]     quick: no -race pass, fewer training steps
# Not yet covered: collective/nccl over an emulated NCCL, the CNN and fp16/bf16 trainings,
# qvd launch --nproc 2 --device cuda.
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-full}
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
emu=$PWD/build/cudaemu
log=$emu/logs
mkdir -p "$log"

step() { echo "== $*"; }

step "build the emulator (make -C internal/cudaemu)"
make -s -C internal/cudaemu OUT="$emu"

step "build bin/qvd-cuda"
go build -tags cuda -o bin/qvd-cuda ./cmd/qvd 2> >(grep -v "handleCUDACB\|^ *[0-9]* |\|^ *|\|In function\|^#" >&2 || true)
missing=$(comm -23 <(nm -D --undefined-only bin/qvd-cuda | awk '$2 ~ /^cu[A-Z]/ {print $2}' | sort -u) \
  <(nm -D --defined-only "$emu/libcuda.so.1" | awk '{print $3}' | sort -u))
if [ -n "$missing" ]; then
  echo "emulate: bin/qvd-cuda links driver entry points the emulator lacks (add them to internal/cudaemu/libcuda/symbols.txt):" >&2
  echo "$missing" >&2
  exit 1
fi

export LD_LIBRARY_PATH=$emu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export QVD_CUBLAS_LIBRARY=$emu/libcublas.so.13
cov=$log/coverage.txt
rm -f "$cov"

step "go test -tags cuda ./engine/cuda (emulated driver)"
# The fp32 comparisons of TestNetMatchesReference assume the reference's summation order
# (a ReLU input within rounding of 0 otherwise flips): sequential GEMMs give it that order.
QVD_CUDAEMU_GEMM=sequential QVD_CUDAEMU_COVERAGE=$cov QVD_CUDAEMU_QUIET=1 \
  go test -tags cuda -count=1 ./engine/cuda 2>&1 | grep -v "handleCUDACB\|^ *[0-9]* |\|^ *|\|In function\|^#" | tee "$log/engine-cuda.log"
test "${PIPESTATUS[0]}" -eq 0

if [ "$mode" != quick ]; then
  step "go test -race -tags cuda ./engine/cuda, operations delayed 50 µs (missing synchronisation shows)"
  QVD_CUDAEMU_GEMM=sequential QVD_CUDAEMU_DELAY_US=50 QVD_CUDAEMU_QUIET=1 \
    go test -race -tags cuda -count=1 ./engine/cuda 2>&1 | grep -v "handleCUDACB\|^ *[0-9]* |\|^ *|\|In function\|^#" | tee "$log/engine-cuda-race.log"
  test "${PIPESTATUS[0]}" -eq 0
fi

step "every kernel ran"
notrun=$(comm -23 <(go run ./internal/cudaemu/gen -src engine/cuda/kernels/kernels.cu | grep -o '^    {"[a-z0-9_]*"' | tr -d ' {"' | sort) \
  <(awk '$1 == "kernel" {print $2}' "$cov" | sort -u))
if [ -n "$notrun" ]; then
  echo "emulate: kernels no test ran:" $notrun >&2
  exit 1
fi
echo "$(awk '$1 == "kernel"' "$cov" | sort -u | wc -l) kernels, $(awk '$1 == "api"' "$cov" | sort -u | wc -l) driver entry points, $(awk '$1 == "cublas"' "$cov" | sort -u | wc -l) cuBLAS entry points used"
if grep -q '^unimplemented' "$cov"; then
  echo "emulate: unimplemented entry points were called:" >&2
  grep '^unimplemented' "$cov" >&2
  exit 1
fi

# last RUN_DIR: the final evaluation's loss and accuracy, and the last training loss.
last() {
  python3 - "$1" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in recs if r["kind"] == "train"]
ev = [r for r in recs if r["kind"] == "eval"]
print(len(tr), tr[-1]["loss"], ev[-1]["loss"], ev[-1]["accuracy"])
PY
}
steps=$([ "$mode" = quick ] && echo 50 || echo 300)
data=/usr/share/datasets/fashion-mnist
for p in fp32 fp16 bf16; do
  step "qvd-cuda train --device cuda against --device reference (MLP, $p, $steps steps)"
  for d in cuda reference; do
    QVD_CUDAEMU_QUIET=1 bin/qvd-cuda train -c configs/fashion-mlp.yaml --device "$d" --precision "$p" --data "$data" \
      --out "$log/train-$p-$d" --max-steps "$steps" --quiet > "$log/train-$p-$d.log" 2>&1 || { cat "$log/train-$p-$d.log"; exit 1; }
  done
  read -r nc lc ec ac < <(last "$log/train-$p-cuda")
  read -r nr lr er ar < <(last "$log/train-$p-reference")
  echo "cuda: $nc steps, train loss $lc, eval loss $ec, accuracy $ac; reference: $nr steps, $lr, $er, $ar"
  python3 -c "import sys; lc,lr,ac,ar=map(float,sys.argv[1:]); sys.exit(0 if abs(lc-lr) <= 0.02*max(1,abs(lr)) and abs(ac-ar) <= 0.01 else 1)" "$ec" "$er" "$ac" "$ar" \
    || { echo "emulate: --device cuda and --device reference diverge ($p)" >&2; exit 1; }
done
echo "emulate: passed (logs in $log)"
