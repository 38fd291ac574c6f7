#!/usr/bin/env bash
# Where the seconds before the first step go, on one GPU. One cold launch compiles gpt2_small into
# the runs' .compile-cache; then WARM (default 3) launches of 2 steps, each a fresh node (/tmp's
# caches emptied; the .compile-cache beside the runs kept); then one run resumed from its
# checkpoint on a fresh node (issue 35, part 3). Per launch: the start-up line (its phases), the
# first step, launch to the end of the first step; then the worker's slowest imports.
# SITE_B=<sed expression> adds a variant: a copy of the package with the expression applied to
# its train.py, launched interleaved with the code as it is (A B B A ...), with A/B per pair.
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-startup.sh
set -uo pipefail
source "$(dirname "$0")/gpu-setup.sh"
cd "$work"
if [[ ${SITE_B:-} ]]; then
  cp -r "$work/site" "$work/siteB"
  sed -i "$SITE_B" "$work/siteB/ddp_project/train.py"
fi
runs=/tmp/startup-runs
rm -rf "$runs"
: >"$OUT/startup.jsonl"
launch() {  # name site run-dir overrides...
  local name=$1 site=$2 run=$3
  shift 3
  rm -rf /tmp/torchinductor_"$(id -un)" "$HOME/.triton/cache"
  local began
  began=$(date +%s.%N)
  PYTHONPATH=$site:$PYTHONPATH timeout 300 python3 -m ddp_project.launch train --standalone --nproc-per-node 1 \
    experiment=gpt2_small trainer.val_every=0 "$@" hydra.run.dir="$run" >"$OUT/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$OUT/$name.log"; }
  local ended
  ended=$(date +%s.%N)
  python3 - "$name" "$OUT/$name.log" "$began" "$ended" >>"$OUT/startup.jsonl" <<'PY'
import json, re, sys, datetime
name, log, began, ended = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
text = open(log).read()
line = re.search(r"start-up ([\d.]+) s: (.*)", text)
first = re.search(r"the first step took ([\d.]+) s", text)
phases = dict((p.rsplit(" ", 2)[0], float(p.rsplit(" ", 2)[1])) for p in line[2].split(", ")) if line else {}
print(json.dumps({"name": name, "start_up_s": float(line[1]) if line else None, "phases": phases,
                  "first_step_s": float(first[1]) if first else None, "wall_s": ended - began,
                  "to_first_step_s": (float(line[1]) + float(first[1])) if line and first else None}))
PY
  grep -h "start-up\|first step took" "$OUT/$name.log" | sed "s/^.*INFO\] - /$name: /"
}
launch cold "$work/site" "$runs/cold" trainer.max_steps=2 trainer.checkpoint_every=0
for i in $(seq "${WARM:-3}"); do
  order=(A)
  [[ ${SITE_B:-} ]] && order=(A B) && ((i % 2 == 0)) && order=(B A)
  for v in "${order[@]}"; do
    site=$work/site
    [[ $v == B ]] && site=$work/siteB
    launch "$v-$i" "$site" "$runs/$v-$i" trainer.max_steps=2 trainer.checkpoint_every=0
  done
done
# Part 3: a run with a checkpoint at step 2, resumed on a fresh node (nothing in /tmp).
launch first "$work/site" "$runs/resumed" trainer.max_steps=2 trainer.checkpoint_every=2
launch resume "$work/site" "$runs/resumed" trainer.max_steps=4 trainer.checkpoint_every=0
# The worker's imports, slowest first (cumulative), as python -X importtime reports them.
python3 -X importtime -c "import ddp_project.train" 2>"$OUT/importtime.txt" >/dev/null
sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -25 >"$OUT/importtime-top.txt"
python3 - "$OUT/startup.jsonl" <<'PY' | tee "$OUT/startup.log"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    print(f"{r['name']:7} start-up {r['start_up_s']} first step {r['first_step_s']} launch->first step end {r['to_first_step_s']} wall {r['wall_s']:.1f}")
    print("        ", r["phases"])
for v in "AB":
    got = [r["to_first_step_s"] for r in rows if r["name"].startswith(v + "-") and r["to_first_step_s"]]
    if got:
        print(v, "launch->first step end: median", statistics.median(got), "range", min(got), max(got))
a = {r["name"][2:]: r["to_first_step_s"] for r in rows if r["name"].startswith("A-")}
b = {r["name"][2:]: r["to_first_step_s"] for r in rows if r["name"].startswith("B-")}
ratios = [a[k] / b[k] for k in a if k in b and a[k] and b[k]]
if ratios:
    print("A/B per pair:", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
PY
cat "$OUT/importtime-top.txt"
