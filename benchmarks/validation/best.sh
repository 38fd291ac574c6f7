#!/usr/bin/env bash
# What trainer.keep_best costs when validations and checkpoints fall on the same steps (best.pt a
# hard link): gpt2_small, 300 steps, validation and checkpoint every 50, keep_best on and off,
# interleaved over 2 rounds. Rows in $OUT/best.jsonl, table in $OUT/best.log.
set -uo pipefail
source "$(dirname "$0")/../../scripts/gpu-setup.sh"
cd "$work"
: >"$OUT/best.jsonl"
for round in 1 2; do
  for keep in true false; do
    run=$work/runs/best-$keep-$round
    started=$(date +%s.%N)
    timeout 280 python3 -m ddp_project.launch train --standalone --nproc-per-node 1 experiment=gpt2_small \
      trainer.max_steps=300 trainer.log_every=50 trainer.val_every=50 trainer.checkpoint_every=50 \
      trainer.keep_best=$keep hydra.run.dir="$run" >"$work/best-$keep-$round.log" 2>&1 \
      || { echo "keep_best=$keep round $round failed"; tail -5 "$work/best-$keep-$round.log"; }
    wall=$(python3 -c "import sys,time; print(round(time.time() - float(sys.argv[1]), 1))" "$started")
    grep -h "best checkpoint\|no hard link" "$work/best-$keep-$round.log" | tail -2 | cut -c1-200
    ls -li "$run/checkpoints" | tail -n +2 | awk '{print "  ", $1, $3, $NF}'
    python3 -c 'import json,sys; [print(json.dumps({**json.loads(l), "variant": sys.argv[2], "round": int(sys.argv[3]), "wall_s": float(sys.argv[4])})) for l in open(sys.argv[1])]' \
      "$run/metrics.jsonl" "keep_best=$keep" "$round" "$wall" >>"$OUT/best.jsonl"
  done
done
python3 - "$OUT/best.jsonl" <<'PY' | tee "$OUT/best.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for variant in ("keep_best=true", "keep_best=false"):
    for rnd in (1, 2):
        mine = [r for r in rows if r["variant"] == variant and r["round"] == rnd]
        ms = [r["step_time_ms"] for r in mine if r["step"] > 50]
        print(variant, "round", rnd, "ms/step after step 50: median", round(statistics.median(ms), 1),
              "min", round(min(ms), 1), "max", round(max(ms), 1), "launch wall s", mine[0]["wall_s"])
PY
