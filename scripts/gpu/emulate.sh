#!/usr/bin/env bash
# Runs the GPU build (-tags cuda) on the CPU through the emulated CUDA driver, cuBLAS and NCCL
# (internal/cudaemu): builds them into build/cudaemu, checks that they define every driver
# entry point bin/qvd-cuda links, runs engine/cuda's tests (the CUDA device against the
# reference device, and the emulator's planted bugs) and collective/nccl's (the conformance
# suite over NCCL at 1, 2 and 4 ranks, one emulated device per rank), checks that every
# kernel ran, trains the MLP (fp32, fp16, bf16) and the CNN on --device cuda against --device
# reference, runs `qvd launch --nproc N --device cuda --transport nccl` against one process
# with the same global batch, and checks that every cuBLAS and NCCL entry point qvd binds was
# called and that no call reached an unimplemented one (the list:
# build/cudaemu/logs/entry-points.txt). docs/gpu.md, "Running the CUDA path without a GPU",
# explains the tolerances and what the emulation cannot show. Needs the CUDA headers and
# OpenBLAS (scripts/setup.sh --cuda).
#   scripts/gpu/emulate.sh [quick]     quick (~2 min): no -race pass, 50-step MLP runs, a
#                                      launch of 2 in fp32 only, no CNN; full: ~10 min
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-full}
# Like scripts/cuda-build.sh: without the CUDA headers it says so and exits 0, unless
# QVD_REQUIRE_CUDA=1 (CI), when that is a failure.
missing_tools=""
[ -f /usr/include/cuda.h ] || missing_tools+=" the CUDA headers (/usr/include/cuda.h)"
command -v g++ >/dev/null || missing_tools+=" g++"
compgen -G "/usr/lib/*/libopenblas.so" >/dev/null || missing_tools+=" OpenBLAS (libopenblas-dev)"
if [ -n "$missing_tools" ]; then
  if [ "${QVD_REQUIRE_CUDA:-0}" = 1 ]; then
    echo "emulate: missing$missing_tools: run scripts/setup.sh --cuda" >&2
    exit 1
  fi
  echo "emulate: SKIPPED the emulated CUDA run: missing$missing_tools (scripts/setup.sh --cuda installs them)"
  exit 0
fi
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

# The fakes are always named: nvidia-cuda-dev may have installed NVIDIA's libraries too.
export LD_LIBRARY_PATH=$emu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export QVD_CUBLAS_LIBRARY=$emu/libcublas.so.13
export QVD_NCCL_LIBRARY=$emu/libnccl.so.2
export QVD_CUDAEMU_QUIET=1
cov=$log/coverage.txt
rm -f "$cov"
export QVD_CUDAEMU_COVERAGE=$cov # every process appends the entry points and kernels it used
cgo_noise="handleCUDACB\|^ *[0-9]* |\|^ *|\|In function\|^#"

step "go test -tags cuda ./engine/cuda (emulated driver)"
# In OpenBLAS's summation order, not the reference's: TestNetMatchesReference draws its fp32
# batches so that no ReLU or max-pool decision lies within rounding of its boundary.
go test -tags cuda -count=1 ./engine/cuda 2>&1 | grep -v "$cgo_noise" | tee "$log/engine-cuda.log"
test "${PIPESTATUS[0]}" -eq 0

if [ "$mode" != quick ]; then
  step "go test -race -tags cuda ./engine/cuda, operations delayed 50 µs (missing synchronisation shows)"
  QVD_CUDAEMU_DELAY_US=50 go test -race -tags cuda -count=1 ./engine/cuda 2>&1 | grep -v "$cgo_noise" | tee "$log/engine-cuda-race.log"
  test "${PIPESTATUS[0]}" -eq 0
fi

# Rank r of a test's group runs on emulated device r. Concurrent calls from several goroutines
# of one rank are documented to fail with collective.ErrProtocol in groups of more than one
# (collective/nccl/doc.go), so the suite's Concurrent case runs at N=1 only.
nccl_test() {
  QVD_CUDAEMU_DEVICES=4 QVD_NCCL_TEST_SIZES=1,2,4 \
    go test -tags cuda -count=1 -skip 'TestConformance/N=[2-9]/Concurrent' "$@" ./collective/nccl 2>&1 | grep -v "$cgo_noise"
}
step "go test -tags cuda ./collective/nccl (emulated NCCL, groups of 1, 2 and 4)"
nccl_test -v | grep -v '^=== \|^ \+--- PASS' | tee "$log/nccl.log"
test "${PIPESTATUS[0]}" -eq 0
if [ "$mode" != quick ]; then
  step "go test -race -tags cuda ./collective/nccl, operations delayed 50 µs"
  QVD_CUDAEMU_DELAY_US=50 nccl_test -race | tee "$log/nccl-race.log"
  test "${PIPESTATUS[0]}" -eq 0
fi

step "every kernel ran"
# The list is kernels.cu's own (every entry point the emulator's table has: the transformer
# layers' kernels too, which engine/cuda's transformer_test.go and the enginetest suite run);
# the cuBLAS entry points checked at the end are those engine/cuda/blas.go binds
# (cublasGemmStridedBatchedEx included).
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

# compare RUN_A RUN_B STEP_TOL UPTO EVAL_TOL ACC_TOL: two runs' train losses at every step up
# to UPTO (relative to max(1, |loss|)), then their last evaluations' loss (relative) and
# accuracy (absolute).
compare() {
  python3 - "$@" <<'PY'
import json, sys
a, b = sys.argv[1], sys.argv[2]
step_tol, upto, tol, acc_tol = float(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
def load(d):
    recs = [json.loads(l) for l in open(d + "/metrics.jsonl")]
    return {r["step"]: r["loss"] for r in recs if r["kind"] == "train"}, [r for r in recs if r["kind"] == "eval"][-1]
(ta, ea), (tb, eb) = load(a), load(b)
rel = lambda s: abs(ta[s] - tb[s]) / max(1, abs(tb[s]))
early = max(rel(s) for s in tb if s <= upto) if ta.keys() == tb.keys() else float("inf")
worst = max(rel(s) for s in tb) if ta.keys() == tb.keys() else float("inf")
print(f"{len(ta)} and {len(tb)} steps, train loss within {early:.2g} to step {min(upto, max(tb))} ({worst:.2g} in all);"
      f" eval loss {ea['loss']:.6f} and {eb['loss']:.6f}, accuracy {ea['accuracy']} and {eb['accuracy']}")
ok = early <= step_tol and abs(ea["loss"] - eb["loss"]) <= tol * max(1, abs(eb["loss"])) and abs(ea["accuracy"] - eb["accuracy"]) <= acc_tol
sys.exit(0 if ok else 1)
PY
}

# Two trainings from the same weights and batches follow one trajectory only while the
# rounding differences of their summation orders stay small; they then grow about
# exponentially. So per-step losses are compared tightly over the first steps, and the end of
# the run only by its evaluation. Measured (300 steps, micro-batch 64): fp32 within 1.7e-6 to
# step 150, 0.0088 by step 200, 0.057 by 300; fp16 and bf16, whose activations round to
# 2^-11 and 2^-8 relative (an fp32 sum in another order now and then rounds to another half
# value), within 2.1e-5 and 9.4e-5 to step 10, 0.08 and 0.11 by step 300. The final
# evaluations (10,000 images) then differ as much as any two runs perturbed by rounding: up to
# 1.4% in loss (fp16) and 0.003 in accuracy; checked to 3% and 0.01.
steps=$([ "$mode" = quick ] && echo 50 || echo 300)
data=/usr/share/datasets/fashion-mnist
for p in fp32 fp16 bf16; do
  step "qvd-cuda train --device cuda against --device reference (MLP, $p, $steps steps)"
  for d in cuda reference; do
    rm -rf "$log/train-$p-$d"
    bin/qvd-cuda train -c configs/fashion-mlp.yaml --device "$d" --precision "$p" --data "$data" \
      --out "$log/train-$p-$d" --max-steps "$steps" --quiet > "$log/train-$p-$d.log" 2>&1 || { cat "$log/train-$p-$d.log"; exit 1; }
  done
  if [ "$p" = fp32 ]; then tight="1e-4 100"; else tight="1e-3 10"; fi
  compare "$log/train-$p-cuda" "$log/train-$p-reference" $tight 0.03 0.01 \
    || { echo "emulate: --device cuda and --device reference diverge ($p)" >&2; exit 1; }
done

# N processes of micro-batch 64/N take the same steps as one of 64 (the global batch is
# micro-batch × world): the gradient all-reduce (ncclAvg) runs through the emulated NCCL
# between the processes, device r for rank r. Only the order of the gradient's sums differs
# (per rank, then across ranks), and in fp32 that stays within 1e-4 over all 300 steps
# (measured 2.4e-7 at 2 processes). In fp16 and bf16 each rank's gradient is rounded to the
# format before the reduction, which rounds again after each rank: the runs part like the
# MLP's above (measured at 2 processes: fp16 within 5.3e-5 to step 10, bf16 3.4e-4, the
# steps 8 times coarser; final evaluations within 0.6% and 0.002), so per-step losses are
# held tightly to step 10 and the end by its evaluation.
launch() { # PRECISION NPROC
  local p=$1 n=$2
  step "qvd-cuda launch --nproc $n --device cuda --transport nccl against one process (MLP, $p, $lsteps steps)"
  local common=(-c configs/fashion-mlp.yaml --device cuda --precision "$p" --data "$data" --seed 5 --max-steps "$lsteps" --quiet)
  rm -rf "$log/launch-$p-n$n"
  QVD_CUDAEMU_DEVICES=$n bin/qvd-cuda launch --nproc "$n" --transport nccl --micro-batch $((64 / n)) --out "$log/launch-$p-n$n" "${common[@]}" \
    > "$log/launch-$p-n$n.log" 2>&1 || { cat "$log/launch-$p-n$n.log"; exit 1; }
  grep -q '"transport": "nccl"' "$log/launch-$p-n$n.log" || { echo "emulate: the launch did not run over NCCL" >&2; exit 1; }
  if [ ! -f "$log/launch-$p-n1/metrics.jsonl" ]; then
    bin/qvd-cuda train --micro-batch 64 --out "$log/launch-$p-n1" "${common[@]}" > "$log/launch-$p-n1.log" 2>&1 \
      || { cat "$log/launch-$p-n1.log"; exit 1; }
  fi
  compare "$log/launch-$p-n$n" "$log/launch-$p-n1" ${LAUNCH_TOL[$p]} \
    || { echo "emulate: $n processes over NCCL diverge from 1 process ($p)" >&2; exit 1; }
}
# STEP_TOL UPTO EVAL_TOL ACC_TOL per precision.
declare -A LAUNCH_TOL=([fp32]="1e-4 1000000 1e-4 0.002" [fp16]="1e-3 10 0.03 0.01" [bf16]="5e-3 10 0.03 0.01")
lsteps=$([ "$mode" = quick ] && echo 100 || echo 300)
rm -rf "$log"/launch-* "$log"/train-cnn-*
launch fp32 2
if [ "$mode" != quick ]; then
  launch fp16 2
  launch bf16 2
  launch fp32 4
fi

if [ "$mode" != quick ]; then
  # The reference device's convolutions are slow on a CPU: small micro-batches and a test
  # subset. Micro-batches of 16 make the trajectories part sooner than the MLP's: measured,
  # within 5.5e-6 to step 50, 2.5e-4 by step 100 and 0.2 by step 200, so the run stops at
  # 100, while its evaluation still means one trajectory (measured: loss within 2.1e-4,
  # accuracy equal). The CUDA convolution (im2col, one GEMM, col2im) sums in another order
  # than the reference's per-sample loops, so QVD_CUDAEMU_GEMM=sequential does not bring them
  # closer (the same 5.5e-6 and 0.2, five times slower): the drift is the model's, not
  # cuBLAS's.
  csteps=100
  step "qvd-cuda train --device cuda against --device reference (CNN, $csteps steps)"
  for d in cuda reference; do
    bin/qvd-cuda train -c configs/fashion-cnn.yaml --device "$d" --data "$data" --micro-batch 16 --test-subset 1000 \
      --out "$log/train-cnn-$d" --max-steps "$csteps" --quiet > "$log/train-cnn-$d.log" 2>&1 || { cat "$log/train-cnn-$d.log"; exit 1; }
  done
  compare "$log/train-cnn-cuda" "$log/train-cnn-reference" 1e-4 50 0.005 0.005 \
    || { echo "emulate: --device cuda and --device reference diverge (CNN)" >&2; exit 1; }
fi

step "entry points"
# Driver: what bin/qvd-cuda links (gorgonia.org/cu links much it never calls) against what the
# runs above called. cuBLAS and NCCL: what engine/cuda and collective/nccl bind, every one of
# which must have been called. No call may have reached an unimplemented stub.
called() { awk -v k="$1" '$1 == k {print $2}' "$cov" | sort -u; }
bound() { grep -o "\"$1[A-Za-z0-9_]*\"}" "$2" | tr -d '"}' | sort -u; }
linked=$(nm -D --undefined-only bin/qvd-cuda | awk '$2 ~ /^cu[A-Z]/ {print $2}' | sort -u)
ep=$log/entry-points.txt
{
  echo "# driver: linked by bin/qvd-cuda and called"; comm -12 <(echo "$linked") <(called api)
  echo "# driver: linked by bin/qvd-cuda, never called"; comm -23 <(echo "$linked") <(called api)
  echo "# cuBLAS: bound by engine/cuda and called"; comm -12 <(bound cublas engine/cuda/blas.go) <(called cublas)
  echo "# cuBLAS: bound by engine/cuda, never called"; comm -23 <(bound cublas engine/cuda/blas.go) <(called cublas)
  echo "# NCCL: bound by collective/nccl and called"; comm -12 <(bound nccl collective/nccl/lib.go) <(called nccl)
  echo "# NCCL: bound by collective/nccl, never called"; comm -23 <(bound nccl collective/nccl/lib.go) <(called nccl)
  echo "# unimplemented entry points called"; called unimplemented
} > "$ep"
echo "driver: $(comm -12 <(echo "$linked") <(called api) | wc -l) of $(echo "$linked" | wc -l) linked entry points called;" \
  "cuBLAS: $(comm -12 <(bound cublas engine/cuda/blas.go) <(called cublas) | wc -l) of $(bound cublas engine/cuda/blas.go | wc -l) bound;" \
  "NCCL: $(comm -12 <(bound nccl collective/nccl/lib.go) <(called nccl) | wc -l) of $(bound nccl collective/nccl/lib.go | wc -l) bound (list: $ep)"
for lib in "cublas engine/cuda/blas.go" "nccl collective/nccl/lib.go"; do
  set -- $lib
  if never=$(comm -23 <(bound "$1" "$2") <(called "$1")) && [ -n "$never" ]; then
    echo "emulate: entry points $2 binds that no run called:" $never >&2
    exit 1
  fi
done
if [ -n "$(called unimplemented)" ]; then
  echo "emulate: unimplemented entry points were called:" $(called unimplemented) >&2
  exit 1
fi
echo "emulate: passed (logs in $log)"
