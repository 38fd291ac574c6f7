#!/usr/bin/env bash
# A/B on one GPU: the issue-23 code (7ad0bee, exported to build/old-template first) against this tree, and this
# tree's new knobs, interleaved round by round. Rows in $OUT/ab.jsonl, table in $OUT/ab.log.
set -uo pipefail
source "$(dirname "$0")/../../scripts/gpu-setup.sh"
old=$(cd "$(dirname "$0")/../.." && pwd)/build/old-template  # git archive 7ad0bee | tar -x -C build/old-template
base=$PYTHONPATH   # $work/site (this tree) first, then the wheels
python3 -m cookiecutter "$old" --no-input -o "$work/old-render" >/dev/null
python3 -m pip install -q --no-deps --no-build-isolation --target "$work/old-site" "$work/old-render/ddp-project"
oldpath=$work/old-site:${base#*:}
cd "$work"
rounds=${ROUNDS:-2}
steps=${STEPS:-80}
variants=(
  "old|$oldpath|experiment=gpt2_small"
  "new-const-noval|$base|experiment=gpt2_small trainer.schedule=constant trainer.val_every=0"
  "new-default|$base|experiment=gpt2_small"
  "new-val20|$base|experiment=gpt2_small trainer.val_every=20"
)
: >"$OUT/ab.jsonl"
for round in $(seq "$rounds"); do
  for v in "${variants[@]}"; do
    IFS='|' read -r name path over <<<"$v"
    run=$work/runs/$name-$round
    # shellcheck disable=SC2086
    PYTHONPATH=$path timeout 300 python3 -m ddp_project.launch train --standalone --nproc-per-node 1 $over \
      trainer.max_steps="$steps" trainer.log_every=10 trainer.checkpoint_every=0 hydra.run.dir="$run" \
      >"$work/$name-$round.log" 2>&1 || { echo "$name round $round failed:"; tail -5 "$work/$name-$round.log"; }
    grep -h "MFU" "$work/$name-$round.log" | tail -1 | cut -c1-250
    python3 -c 'import json,sys; [print(json.dumps({**json.loads(l), "variant": sys.argv[2], "round": int(sys.argv[3])})) for l in open(sys.argv[1])]' \
      "$run/metrics.jsonl" "$name" "$round" >>"$OUT/ab.jsonl" 2>/dev/null
  done
done
python3 - "$OUT/ab.jsonl" <<'PY' | tee "$OUT/ab.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("variant            rounds  MFU median (min-max)   ms/step median (min-max)")
for variant in dict.fromkeys(r["variant"] for r in rows):
    per_round = {}
    for r in rows:
        if r["variant"] == variant and r["step"] > 20:
            per_round.setdefault(r["round"], []).append(r)
    mfu = [statistics.median(x["mfu"] for x in rs) for rs in per_round.values()]
    ms = [statistics.median(x["step_time_ms"] for x in rs) for rs in per_round.values()]
    print(f"{variant:18} {len(mfu):>6}  {statistics.median(mfu):.3f} ({min(mfu):.3f}-{max(mfu):.3f})   "
          f"{statistics.median(ms):.1f} ({min(ms):.1f}-{max(ms):.1f})")
PY
