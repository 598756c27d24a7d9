#!/usr/bin/env bash
# What elastic training's neighbour snapshots cost, as users see it: four workers (qvd launch
# --min-nodes 2, so the job is elastic) of the 36.8M-parameter MLP (bench/mlp-37m.yaml), ZeRO
# stage 2, micro-batch 16, fp32 AdamW, with elastic.snapshot_every -1 (off), 1 (every step)
# and 0 (auto: every step when that costs under 5% of the step, else the interval that does),
# rounds interleaved. It reports rank 0's median step time after the warm-up (auto measures
# during its first 6 steps) and each setting's cost against "off".
#   bench/snapshot-cost.sh [ROUNDS] [STEPS] [TRANSPORT]     (default 3 rounds, 40 steps, auto)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-40}
transport=${3:-auto}
warm=12
qvd=${QVD:-bin/qvd}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() { # run SNAPSHOT_EVERY OUT
  local cfg="$tmp/cfg$1.yaml"
  { cat bench/mlp-37m.yaml; printf 'elastic:\n  snapshot_every: %s\n' "$1"; } > "$cfg"
  rm -rf "$2"
  "$qvd" launch --nproc 4 --min-nodes 2 -c "$cfg" --zero-stage 2 --micro-batch 16 --max-steps "$steps" \
    --test-subset 500 --transport "$transport" --quiet --out "$2" > "$2.log" 2>&1 || { cat "$2.log"; exit 1; }
}
summarise() { # METRICS LOG
  /usr/bin/python3 - "$1" "$warm" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l][int(sys.argv[2]):]
print(f"{statistics.median([64 / r['samples_per_sec'] for r in recs]):.4f}")
PY
}
echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; transport $transport, $steps steps (medians after $warm)"
echo "# round snapshot_every step_s chosen"
for r in $(seq "$rounds"); do
  for every in -1 1 0; do
    run "$every" "$tmp/run$every"
    chosen=$(cat "$tmp/run$every.log" "$tmp/run$every"/*.log 2>/dev/null | grep -o '"every_steps": *[0-9]*' | head -1 | grep -o '[0-9]*$' || true)
    echo "$r $every $(summarise "$tmp/run$every/metrics.jsonl") ${chosen:--}"
  done
done | tee "$tmp/all"
/usr/bin/python3 - "$tmp/all" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if not l.startswith("#")]
by = {}
for r in rows:
    by.setdefault(r[1], []).append(float(r[2]))
off = statistics.median(by["-1"])
for k, name in (("-1", "off"), ("1", "every step"), ("0", "auto")):
    xs = by[k]
    m = statistics.median(xs)
    print(f"{name:11s} {m:.4f} s/step (range {min(xs):.4f}-{max(xs):.4f}), cost {100 * (m / off - 1):+.1f}% (target <= 5%)")
PY
