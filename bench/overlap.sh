#!/usr/bin/env bash
# Overlap of the gradient's communication with the backward pass, measured as users see it:
# four workers of the 36.8M-parameter MLP (bench/mlp-37m.yaml), ZeRO stage 2, micro-batch 16,
# fp32 AdamW, one thread each, run with zero_optimization.overlap_comm on and off, rounds
# interleaved. With overlap off each bucket is reduced inside the backward pass, so rank 0's
# metrics separate the parts: backward alone = forward_backward - reduction; communication
# alone = reduction + param_gather (the gradient's reduce-scatter and the updated parameters'
# all-gather: all a stage-2 step sends). With overlap on (the reduce-scatter beside the backward
# pass, the all-gather beside the next forward pass) the step is compared with
# max(backward, communication).
#   bench/overlap.sh [ROUNDS] [STEPS] [TRANSPORT] [LINK]   (default 3 rounds, 25 steps, tcp, loopback)
# LINK "loopback": the four workers of one `qvd launch --nproc 4` on this host. LINK a tc rate
# (1gbit, 10gbit): four "hosts", each a network and IPC namespace running `qvd launch --nnodes
# 4 --nproc 1`, joined by a bridge whose ports pass LINK each way (tbf on both ends of every
# veth), as four machines on one switch. Needs root.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
steps=${2:-25}
transport=${3:-tcp}
link=${4:-loopback}
warm=5
qvd=${QVD:-bin/qvd}
tmp=$(mktemp -d)
ns=qvdo$$
cleanup() {
  if [ "$link" != loopback ]; then
    for r in 0 1 2 3 sw; do ip netns del "$ns-$r" 2>/dev/null || true; done
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
if [ "$link" != loopback ]; then
  [ "$(id -u)" -eq 0 ] || { echo "overlap: LINK $link needs root (network namespaces, tc)" >&2; exit 1; }
  # The switch has a namespace of its own: the host's firewall (Docker's FORWARD policy, with
  # br_netfilter) would filter a bridge in the root namespace.
  ip netns add "$ns-sw"
  ip -n "$ns-sw" link add name qvdsw type bridge
  ip -n "$ns-sw" link set dev qvdsw up
  for r in 0 1 2 3; do
    ip netns add "$ns-$r"
    ip link add "${ns}h$r" type veth peer name "${ns}s$r"
    ip link set "${ns}h$r" netns "$ns-$r"
    ip link set "${ns}s$r" netns "$ns-sw"
    ip -n "$ns-sw" link set "${ns}s$r" master qvdsw
    ip -n "$ns-sw" link set "${ns}s$r" up
    ip -n "$ns-$r" addr add "10.79.0.$((r + 1))/24" dev "${ns}h$r"
    ip -n "$ns-$r" link set lo up
    ip -n "$ns-$r" link set "${ns}h$r" up
    # The host's port sends at LINK, and so does the switch's port toward it.
    ip netns exec "$ns-$r" tc qdisc add dev "${ns}h$r" root tbf rate "$link" burst 1mb latency 100ms
    ip netns exec "$ns-sw" tc qdisc add dev "${ns}s$r" root tbf rate "$link" burst 1mb latency 100ms
  done
  QVD_CLUSTER_KEY=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
  export QVD_CLUSTER_KEY
fi
run() { # run OVERLAP OUT: rank 0's run directory is OUT
  local ds="$tmp/ds-$1.json"
  printf '{"zero_optimization": {"stage": 2, "overlap_comm": %s}}\n' "$1" > "$ds"
  local args=(-c bench/mlp-37m.yaml --deepspeed "$ds" --micro-batch 16 --max-steps "$steps" --threads 1
    --test-subset 500 --transport "$transport" --quiet)
  rm -rf "$2" "$2".*
  if [ "$link" = loopback ]; then
    "$qvd" launch --nproc 4 "${args[@]}" --out "$2" > "$2.log" 2>&1 || { cat "$2.log"; exit 1; }
    return
  fi
  local pids=() r out ok=1 p
  for r in 0 1 2 3; do
    out=$2; [ "$r" = 0 ] || out=$2.node$r
    ip netns exec "$ns-$r" unshare --ipc --mount sh -c 'mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec "$@"' sh \
      "$qvd" launch --nnodes 4 --node-rank "$r" --nproc 1 --master-addr 10.79.0.1 --host "10.79.0.$((r + 1))" \
      "${args[@]}" --out "$out" > "$out.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  ((ok)) || { tail -n 20 "$2".*log "$2.log"; exit 1; }
}
# Medians over the steps after the warm-up: step seconds (the wall time between consecutive
# step records, what a user sees: with overlap_comm the parameters' all-gather runs under the
# next step's forward pass, outside the step's own samples_per_sec window) and the phases.
summarise() { # METRICS
  /usr/bin/python3 - "$1" "$warm" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"train"' in l]
recs = recs[int(sys.argv[2]):]
med = lambda xs: statistics.median(xs)
step = med([b["time"] - a["time"] for a, b in zip(recs, recs[1:])])
fb = med([r["phase_seconds"]["forward_backward"] for r in recs])
red = med([r["phase_seconds"].get("reduction", 0) for r in recs])
gath = med([r["phase_seconds"].get("param_gather", 0) for r in recs])
wait = med([r["phase_seconds"].get("gradient_wait", 0) for r in recs])
print(f"{step:.4f} {fb:.4f} {red:.4f} {wait:.4f} {gath:.4f}")
PY
}
echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; transport $transport, link $link, $steps steps (medians after $warm)"
echo "# round overlap step_s forward_backward_s reduction_s gradient_wait_s param_gather_s"
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
red = med([r[2] for r in off])                 # the gradient's reduce-scatter alone
gath = med([r[4] for r in off])                # the parameters' all-gather alone
comm = med([r[2] + r[4] for r in off])         # communication alone: both
serial = med([r[0] for r in off])
print(f"step with overlap      {step:.4f} s (range {min(r[0] for r in on):.4f}-{max(r[0] for r in on):.4f})")
print(f"step without overlap   {serial:.4f} s")
print(f"backward alone         {bwd:.4f} s")
print(f"communication alone    {comm:.4f} s (reduce-scatter {red:.4f}, all-gather {gath:.4f})")
print(f"step / max(backward, communication) = {step / max(bwd, comm):.3f}  (target <= 1.15)")
PY
