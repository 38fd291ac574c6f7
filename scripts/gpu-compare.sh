#!/usr/bin/env bash
# The bench of this tree's project against another commit's, interleaved in one call: each launch
# measures the template's loop against the hand-written reference (template / reference), and
# the launches alternate ref, this, this, ref, ... so that a drift of the machine falls on both.
#   git archive <commit> --prefix=ref/ | tar -x -C .bench-ref    # here; .bench-ref/ is git-ignored
#   device run (kind nvidia-h200, carry .whl and .bench-ref):  bash scripts/gpu-compare.sh
# ROUNDS (default 2) pairs of launches per experiment; EXPERIMENTS (default gpt2_small); PAIRS (3);
# BENCH_ARGS more bench options (e.g. --warmup 10 --steps 25); LAUNCH_TIMEOUT (280 s).
set -euo pipefail
repo=$PWD
if [[ ! -f .bench-ref/ref/cookiecutter.json ]]; then
  echo "gpu-compare: no .bench-ref/ref/ to compare with; stage it: git archive <commit> --prefix=ref/ | tar -x -C .bench-ref" >&2
  exit 2
fi
source "$(dirname "$0")/gpu-setup.sh"   # this tree: $project installed in $work/site
ref_render=$work/ref-render
python3 -m cookiecutter "$repo/.bench-ref/ref" --no-input -o "$ref_render"
python3 -m pip install -q --no-deps --no-build-isolation --target "$work/ref-site" "$ref_render/ddp-project"
this_path=$PYTHONPATH
ref_path=$work/ref-site:${PYTHONPATH#"$work/site:"}
cd "$work"
launch() {  # launch WHICH EXPERIMENT ROUND
  local path=$this_path; [[ $1 == ref ]] && path=$ref_path
  # shellcheck disable=SC2086  # BENCH_ARGS: more bench options, word-split
  if PYTHONPATH=$path timeout "${LAUNCH_TIMEOUT:-280}" python3 -m ddp_project.bench --pairs "${PAIRS:-3}" ${BENCH_ARGS:-} \
      --json "$work/$1-$2-$3.json" "experiment=$2" >>"$OUT/compare-$1.log" 2>&1; then
    python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); r.update(which=sys.argv[2], experiment=sys.argv[3]); print(json.dumps(r))' \
      "$work/$1-$2-$3.json" "$1" "$2" >>"$OUT/compare.jsonl"
  else
    echo "$1 $2 round $3 failed: see compare-$1.log"; tail -3 "$OUT/compare-$1.log"
  fi
}
for experiment in ${EXPERIMENTS:-gpt2_small}; do
  for round in $(seq "${ROUNDS:-2}"); do
    if (( round % 2 )); then order="ref this"; else order="this ref"; fi
    for which in $order; do launch "$which" "$experiment" "$round"; done
  done
done
python3 - "$OUT/compare.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'experiment':<12}{'which':<6}{'launch: template / reference (median of its pairs)':<52}{'MFU':>7}")
for r in rows:
    t = r["template_over_reference"]["1"]
    mfu = (r.get("mfu") or {}).get("1", {}).get("template", {}).get("median", float("nan"))
    print(f"{r['experiment']:<12}{r['which']:<6}{t['median']:.3f} ({t['min']:.3f}-{t['max']:.3f}){'':<29}{mfu:7.3f}")
for experiment in sorted({r["experiment"] for r in rows}):
    med = {w: [r["template_over_reference"]["1"]["median"] for r in rows if r["experiment"] == experiment and r["which"] == w]
           for w in ("ref", "this")}
    if med["ref"] and med["this"]:
        print(f"{experiment}: this / ref = {statistics.median(med['this']) / statistics.median(med['ref']):.3f} "
              f"(this {med['this']}, ref {med['ref']})")
PY
