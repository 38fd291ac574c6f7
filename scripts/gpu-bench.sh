#!/usr/bin/env bash
# The bench table of BENCHMARKS.md: the generated project's `bench` on the 134M-parameter model
# with its defaults, with DDP's own defaults, with single knobs changed, and under pcie_safe.
# Every JSON goes to $OUT/bench.jsonl, the printed tables to $OUT/bench.log.
#   scripts/fetch-gpu-wheels.sh   # once, here
#   device run (kind nvidia-h200-x2, carry .whl):  bash scripts/gpu-bench.sh
set -euo pipefail
source "$(dirname "$0")/gpu-setup.sh"
cd "$work"
: >"$OUT/bench.jsonl"
bench() {  # bench NAME [overrides...]; ONLY="name ..." runs just those
  local name=$1; shift
  [[ -z "${ONLY:-}" || " $ONLY " == *" $name "* ]] || return 0
  echo "== $name: $*" | tee -a "$OUT/bench.log"
  if python3 -m ddp_project.bench --json "$work/$name.json" "$@" >>"$OUT/bench.log" 2>&1; then
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r["name"]=sys.argv[2]; print(json.dumps(r))' \
      "$work/$name.json" "$name" >>"$OUT/bench.jsonl"
  else
    echo "   failed, see bench.log" | tee -a "$OUT/bench.log"; tail -5 "$OUT/bench.log"
  fi
}
M=experiment=mlp_134m
bench template-defaults $M
bench ddp-defaults $M dist.bucket_cap_mb=25 dist.gradient_as_bucket_view=false dist.static_graph=false trainer.fused_optimizer=false
bench static-graph-off $M dist.static_graph=false
bench no-comm-timing $M dist.time_comm=false
bench bucket-25 $M dist.bucket_cap_mb=25
bench hook-bf16 $M dist.comm_hook=bf16
bench pcie-safe $M nccl=pcie_safe
bench batch-1024 $M data.batch_size=1024
bench small-model
python3 - "$OUT/bench.jsonl" <<'PY' | tee -a "$OUT/bench.log"
import json, sys
print(f"{'name':<18}{'1 GPU ms':>9}{'N GPU ms':>9}{'no-sync':>8}{'minimal':>8}{'eff':>7}{'ovh':>7}{'busbw':>7}{'exposed':>8}")
for line in open(sys.argv[1]):
    r = json.loads(line); runs = r["runs"]; n = r["processes"]
    g = lambda k: runs.get(k, {}).get("step_time_ms", float("nan"))
    print(f"{r['name']:<18}{g('template_1'):9.2f}{g(f'template_{n}'):9.2f}{g(f'no_grad_sync_{n}'):8.2f}"
          f"{g('minimal_1'):8.2f}{r.get('scaling_efficiency', float('nan')):7.3f}{r['overhead_ratio']:7.3f}"
          f"{r.get('gradient_allreduce', {}).get('busbw_gbps', float('nan')):7.1f}{r.get('exposed_comm_share', float('nan')):8.2f}")
PY
