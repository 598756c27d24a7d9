#!/usr/bin/env bash
# Runs the GPU checks of docs/gpu.md on a machine with an NVIDIA GPU, from the files
# scripts/gpu/prepare.sh built (gpu-run/). Writes logs and a summary to ${OUT:-gpu-results}.
#   scripts/gpu/run.sh [quick|all]     quick: kernels, NCCL, short runs; all: full trainings
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-quick}
res=${OUT:-gpu-results}
mkdir -p "$res"
bin=gpu-run/bin
data=gpu-run/data
# NVIDIA's pip wheels (PyTorch's) carry libcublas.so.13 and libnccl.so.2; qvd finds them there
# by itself, but an explicit path is printed for the record.
for lib in libcublas.so.13 libnccl.so.2; do
  p=$(ls /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib/$lib 2>/dev/null | head -1)
  echo "$lib: ${p:-not found in the pip wheels}" | tee -a "$res/summary.txt"
done
step() { echo "== $*" | tee -a "$res/summary.txt"; }

step "nvidia-smi"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$res/summary.txt"
step "qvd gpus"; $bin/qvd gpus 2>&1 | tee -a "$res/summary.txt"
step "CUDA backend against the reference device"; $bin/gpu-cuda.test -test.v -test.bench . -test.benchtime 2s > "$res/gpu-cuda.log" 2>&1; echo "exit $?" | tee -a "$res/summary.txt"
grep -E "^(--- |ok|FAIL|PASS|Benchmark)" "$res/gpu-cuda.log" | tee -a "$res/summary.txt"
step "NCCL communicator, one rank"; $bin/nccl.test -test.v > "$res/nccl.log" 2>&1; echo "exit $?" | tee -a "$res/summary.txt"
grep -E "^(--- |ok|FAIL|PASS)" "$res/nccl.log" | tail -20 | tee -a "$res/summary.txt"

# figures RUN_DIR: accuracy, median samples/s, peak device memory from metrics.jsonl.
figures() {
  python3 - "$1" <<'PY'
import json, sys, statistics
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
tr = [r for r in recs if r["kind"] == "train"]
ev = [r for r in recs if r["kind"] == "eval"]
sps = statistics.median(r.get("samples_per_sec", 0) for r in tr[10:] or tr)
peak = max(r.get("gpu", {}).get("qvd_max_allocated", 0) for r in tr)
nv = max((v for r in tr for k, v in r.get("gpu", {}).items() if k.endswith("_used")), default=0)
print(f"steps {len(tr)}  accuracy {ev[-1]['accuracy'] if ev else float('nan'):.4f}  median {sps:,.0f} samples/s  "
      f"({1e3 * 64 / sps if sps else 0:.3f} ms/step at 64)  qvd peak allocated {peak / 2**20:.1f} MiB  NVML used {nv / 2**20:.0f} MiB")
PY
}
train() { # name args...
  local name=$1; shift
  step "train $name: qvd train $*"
  local t0=$SECONDS
  $bin/qvd train --device cuda --data "$data" --out "$res/$name" --quiet "$@" > "$res/$name.log" 2>&1
  echo "exit $? in $((SECONDS - t0)) s" | tee -a "$res/summary.txt"
  grep -E "^done|test accuracy" "$res/$name.log" | tail -1 | tee -a "$res/summary.txt"
  figures "$res/$name" | tee -a "$res/summary.txt"
}
if [ "$mode" = all ]; then
  for p in fp32 fp16 bf16; do train "mlp-$p" -c configs/fashion-mlp.yaml --precision "$p"; done
  train cnn-fp32 -c configs/fashion-cnn.yaml
  train mlp-cpu -c configs/fashion-mlp.yaml --device cpu
else
  for p in fp32 fp16 bf16; do train "mlp-$p" -c configs/fashion-mlp.yaml --precision "$p" --epochs 1; done
  train cnn-fp32 -c configs/fashion-cnn.yaml --epochs 1
fi
# Several processes sharing the one GPU over the gRPC transport (the global batch kept: 64).
for np in 1 2 4; do
  step "launch --nproc $np --device cuda (gRPC, one GPU shared)"
  t0=$SECONDS
  $bin/qvd launch --nproc "$np" -c configs/fashion-mlp.yaml --device cuda --data "$data" --micro-batch $((64 / np)) \
    --out "$res/launch-$np" --quiet $([ "$mode" = all ] || echo --epochs 1) > "$res/launch-$np.log" 2>&1
  echo "exit $? in $((SECONDS - t0)) s" | tee -a "$res/summary.txt"
  figures "$res/launch-$np" | tee -a "$res/summary.txt"
done
step "PyTorch, same MLP and batch"
for p in fp32 fp16 bf16; do python3 bench/torch_mlp.py --batch 64 --precision "$p" --steps 3000 2>&1 | tail -1 | tee -a "$res/summary.txt"; done
[ "$mode" = all ] && python3 bench/torch_mlp.py --batch 64 --epochs 15 --data "$data" 2>&1 | tail -1 | tee -a "$res/summary.txt"
echo "summary: $res/summary.txt"
