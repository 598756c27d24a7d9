#!/usr/bin/env bash
# docs/memory.md's ViT table: the peak RSS of the largest of 2 workers (GNU time's maximum
# resident set of `qvd launch`'s children) and the median time per step of a ViT-S/7
# (bench/vit-s7.yaml, 21.3M parameters) for ZeRO stage 0/1/2, activation checkpointing on and
# off, and freezing 0/0.5/0.75 of the blocks. Rounds are interleaved; each prints one line:
#   name rss_mib step_seconds
#   bench/vit-memory.sh [ROUNDS] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
steps=${2:-8}
export OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-Haswell}
go build -o bin/qvd ./cmd/qvd
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cases=(
  "stage0|--zero-stage 0"
  "stage1|--zero-stage 1"
  "stage2|--zero-stage 2"
  "stage2+ckpt6|--zero-stage 2 --activation-checkpointing 6"
  "stage0+ckpt6|--zero-stage 0 --activation-checkpointing 6"
  "stage0+freeze0.5|--zero-stage 0 -c $tmp/freeze0.5.yaml"
  "stage0+freeze0.75|--zero-stage 0 -c $tmp/freeze0.75.yaml"
)
for f in 0.5 0.75; do
  { cat bench/vit-s7.yaml; echo "freeze: {ratio: $f}"; } >"$tmp/freeze$f.yaml"
done
for r in $(seq "$rounds"); do
  for c in "${cases[@]}"; do
    name=${c%%|*}
    flags=${c#*|}
    out=$tmp/$name-$r
    # shellcheck disable=SC2086
    /usr/bin/time -f "%M" -o "$out.time" bin/qvd launch --nproc 2 -c bench/vit-s7.yaml --max-steps "$steps" \
      --out "$out" --quiet $flags >"$out.log" 2>&1 || { echo "$name: failed, see below" >&2; tail -5 "$out.log" >&2; continue; }
    rss=$(( $(tail -1 "$out.time") / 1024 ))
    # Median step time from rank 0's metrics, the first two steps (warm-up) left out.
    st=$(python3 -c '
import json,sys,statistics
ts=[json.loads(l)["time"] for l in open(sys.argv[1]) if "\"kind\":\"train\"" in l]
d=[b-a for a,b in zip(ts,ts[1:])][2:]
print("%.3f" % statistics.median(d))' "$out/metrics.jsonl")
    echo "$name $rss $st"
  done
done
