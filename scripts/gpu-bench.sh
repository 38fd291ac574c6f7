#!/usr/bin/env bash
# The bench table of BENCHMARKS.md: the generated project's `bench` (template and hand-written
# reference interleaved in one launch) on mlp_134m and gpt2_small with their defaults, and rows with
# one knob changed. Every report goes to $OUT/bench.jsonl, the printed tables to $OUT/bench.log.
#   scripts/fetch-gpu-wheels.sh   # once, here
#   device run (kind nvidia-h200-x2, carry .whl):  bash scripts/gpu-bench.sh
# ONLY="mlp gpt2" picks rows; PAIRS (default 5) sets the pairs per row. ATTRIBUTION=1 first runs
# benchmarks/loop-overhead/attribution.py; with ../shared/bench/ddp_ref.py copied to .ref/ (and
# carried), REF=1 runs it as a cross-check of the bench's own reference loop.
set -euo pipefail
repo=$PWD
source "$(dirname "$0")/gpu-setup.sh"
cd "$work"
pairs=${PAIRS:-5}
if [[ "${ATTRIBUTION:-0}" == 1 ]]; then
  PAIRS=$pairs timeout 300 torchrun --standalone --nproc-per-node 2 \
    "$repo/benchmarks/loop-overhead/attribution.py" 2>&1 | grep RESULT | tee "$OUT/attribution.log" || true
fi
if [[ "${REF:-0}" == 1 && -f "$repo/.ref/ddp_ref.py" ]]; then
  for kind in mlp gpt; do
    KIND=$kind REPS=3 timeout 200 torchrun --standalone --nproc-per-node 2 "$repo/.ref/ddp_ref.py" 2>&1 \
      | grep RESULT | tee -a "$OUT/ddp_ref.log" || true
  done
fi
touch "$OUT/bench.jsonl"
bench() {  # bench NAME [overrides...]
  local name=$1; shift
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  echo "== $name: $*" | tee -a "$OUT/bench.log"
  if timeout "${ROW_TIMEOUT_S:-400}" python3 -m ddp_project.bench --pairs "$pairs" --json "$work/$name.json" "$@" \
      >>"$OUT/bench.log" 2>&1; then
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r["name"]=sys.argv[2]; print(json.dumps(r))' \
      "$work/$name.json" "$name" >>"$OUT/bench.jsonl"
  else
    echo "   failed, see bench.log" | tee -a "$OUT/bench.log"; tail -5 "$OUT/bench.log"
  fi
}
M=experiment=mlp_134m
G=experiment=gpt2_small
bench mlp $M
bench gpt2 $G
bench mlp-time-comm $M dist.time_comm=true
bench mlp-bucket-25 $M dist.bucket_cap_mb=25
bench mlp-bucket-400 $M dist.bucket_cap_mb=400
bench mlp-bf16 $M dist.comm_hook=bf16
bench gpt2-bucket-25 $G dist.bucket_cap_mb=25
bench gpt2-bucket-50 $G dist.bucket_cap_mb=50
bench gpt2-bucket-200 $G dist.bucket_cap_mb=200
bench gpt2-bf16 $G dist.comm_hook=bf16
bench gpt2-static $G dist.static_graph=true
bench mlp-pcie-safe $M nccl=pcie_safe
python3 - "$OUT/bench.jsonl" <<'PY' | tee -a "$OUT/bench.log"
import json, sys
def f(s): return f"{s['median']:.3f} ({s['min']:.2f}-{s['max']:.2f})"
print(f"{'row':<16}{'t/r 1 GPU':>21}{'t/r N GPUs':>21}{'eff template':>21}{'eff reference':>21}{'AR ms':>7}{'extra ms':>9}")
for line in open(sys.argv[1]):
    r = json.loads(line); n = str(r["processes"]); e = r.get("scaling_efficiency", {})
    print(f"{r['name']:<16}{f(r['template_over_reference']['1']):>21}{f(r['template_over_reference'][n]):>21}"
          f"{f(e['template']) if e else '-':>21}{f(e['reference']) if e else '-':>21}"
          f"{r['gradient_allreduce']['time_ms'] if r['gradient_allreduce'] else 0:7.2f}{r.get('exposed_comm_ms', 0):9.2f}")
PY
