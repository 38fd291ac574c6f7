#!/usr/bin/env bash
# log_every 10 against 50 (validation every 50) on gpt2_small, 300 steps, interleaved.
set -uo pipefail
source "$(dirname "$0")/../../scripts/gpu-setup.sh"
cd "$work"
: >"$OUT/ab2.jsonl"
for round in 1 2; do
  for every in 10 50; do
    run=$work/runs/log$every-$round
    timeout 280 python3 -m ddp_project.launch train --standalone --nproc-per-node 1 experiment=gpt2_small \
      trainer.max_steps=300 trainer.log_every=$every trainer.val_every=50 trainer.checkpoint_every=0 hydra.run.dir="$run" \
      >"$work/log$every-$round.log" 2>&1 || { echo "log$every round $round failed"; tail -5 "$work/log$every-$round.log"; }
    grep -h "MFU" "$work/log$every-$round.log" | tail -2 | cut -c1-250
    python3 -c 'import json,sys; [print(json.dumps({**json.loads(l), "variant": sys.argv[2], "round": int(sys.argv[3])})) for l in open(sys.argv[1])]' \
      "$run/metrics.jsonl" "log$every" "$round" >>"$OUT/ab2.jsonl"
  done
done
python3 - "$OUT/ab2.jsonl" <<'PY' | tee "$OUT/ab2.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for variant in ("log10", "log50"):
    for rnd in (1, 2):
        ms = [r["step_time_ms"] for r in rows if r["variant"] == variant and r["round"] == rnd and r["step"] > 50]
        vt = [r["val_time_s"] for r in rows if r["variant"] == variant and r["round"] == rnd and r["val_time_s"]]
        print(variant, rnd, "ms/step median", round(statistics.median(ms), 1), "min", round(min(ms), 1), "max", round(max(ms), 1), "val s", [round(v, 3) for v in vt])
PY
