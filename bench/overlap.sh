#!/usr/bin/env bash
# Overlap of the gradient's communication with the backward pass, measured as users see it:
# four workers (qvd launch) of the 36.8M-parameter MLP (bench/mlp-37m.yaml), ZeRO stage 2,
# micro-batch 16, fp32 AdamW, run with zero_optimization.overlap_comm on and off, rounds
# interleaved. With overlap off each bucket is reduced inside the backward pass, so rank 0's
# metrics separate the two: backward alone = forward_backward - reduction, communication
# alone = reduction. With overlap on the step is compared with max(backward, communication).
#   bench/overlap.sh [ROUNDS] [STEPS] [TRANSPORT]     (default 3 rounds, 25 steps, tcp)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-25}
transport=${3:-tcp}
warm=5
qvd=${QVD:-bin/qvd}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # run OVERLAP OUT
  local ds="$tmp/ds-$1.json"
  printf '{"zero_optimization": {"stage": 2, "overlap_comm": %s}}\n' "$1" > "$ds"
  rm -rf "$2"
  "$qvd" launch --nproc 4 -c bench/mlp-37m.yaml --deepspeed "$ds" --micro-batch 16 --max-steps "$steps" \
    --test-subset 500 --transport "$transport" --quiet --out "$2" > "$2.log" 2>&1 || { cat "$2.log"; exit 1; }
}
# Medians over the steps after the warm-up: step seconds (global batch / samples_per_sec)
# and the phases.
summarise() { # METRICS
  /usr/bin/python3 - "$1" "$warm" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
recs = recs[int(sys.argv[2]):]
med = lambda xs: statistics.median(xs)
step = med([64 / r["samples_per_sec"] for r in recs])
fb = med([r["phase_seconds"]["forward_backward"] for r in recs])
red = med([r["phase_seconds"].get("reduction", 0) for r in recs])
wait = med([r["phase_seconds"].get("gradient_wait", 0) for r in recs])
print(f"{step:.4f} {fb:.4f} {red:.4f} {wait:.4f}")
PY
}
echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; transport $transport, $steps steps (medians after $warm)"
echo "# round overlap step_s forward_backward_s reduction_s gradient_wait_s"
for r in $(seq "$rounds"); do
  for ov in true false; do
    run "$ov" "$tmp/run-$ov"
    echo "$r $ov $(summarise "$tmp/run-$ov/metrics.jsonl")"
  done
done | tee "$tmp/all"
/usr/bin/python3 - "$tmp/all" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if not l.startswith("#")]
on = [list(map(float, r[2:])) for r in rows if r[1] == "true"]
off = [list(map(float, r[2:])) for r in rows if r[1] == "false"]
med = lambda xs: statistics.median(xs)
step = med([r[0] for r in on])
bwd = med([r[1] - r[2] for r in off])          # backward alone: the pass minus its inline reductions
comm = med([r[2] for r in off])                # communication alone
serial = med([r[0] for r in off])
print(f"step with overlap      {step:.4f} s (range {min(r[0] for r in on):.4f}-{max(r[0] for r in on):.4f})")
print(f"step without overlap   {serial:.4f} s")
print(f"backward alone         {bwd:.4f} s")
print(f"communication alone    {comm:.4f} s")
print(f"step / max(backward, communication) = {step / max(bwd, comm):.3f}  (target <= 1.15)")
PY
