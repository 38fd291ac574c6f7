#!/usr/bin/env bash
# Launch -> first finished step on one GPU, for this tree's project against another commit's
# (.bench-ref/ref, as gpt-compare.sh stages it), interleaved round by round. Each round and
# variant has runs of its own, on a fresh node each launch (/tmp's caches emptied):
#   cold    a new run, nothing cached anywhere (COLD_STEPS steps, default 2, and a checkpoint);
#   resched that run resumed, its storage kept: a rescheduled pod (2 steps more);
#   rerun   a new run dir beside it: the next run, finding the earlier one's caches (RERUN=0: none).
# With COLD_STEPS past 20, the cold runs' MFU over their windows after step 20 (10 steps each) too.
# VARIANT_SED="NAME|FILE|EXPRESSION" adds variant NAME: this tree's package with the sed EXPRESSION
# applied to FILE (as in gpu-mfu.sh), e.g. the model compiled whole:
#   VARIANT_SED="whole|run/compilation.py|s/regions = repeated_blocks(bare)/regions = []/"
# Per launch: the start-up line's phases, the first step (its compile), launch -> first step
# done. Rows in $OUT/startup.jsonl, table in $OUT/startup.log, the launches' logs in
# $OUT/startup-logs.tgz.
#   git archive <commit> --prefix=ref/ | tar -x -C .bench-ref    # here; .bench-ref/ is git-ignored
#   device run (kind nvidia-h200, carry .whl and .bench-ref):  bash scripts/gpu-startup.sh
# ROUNDS (default 2); OVERRIDES (default experiment=gpt2_small trainer.val_every=0); STOP_AFTER_S:
# no launch starts after that many seconds of the script; LAUNCH_TIMEOUT (default 200 s).
set -uo pipefail
stop_after=${STOP_AFTER_S:-86400}
repo=$PWD
source "$(dirname "$0")/gpu-setup.sh"
variants=(new)
declare -A paths=([new]=$PYTHONPATH)
if [[ -f $repo/.bench-ref/ref/cookiecutter.json ]]; then
  python3 -m cookiecutter "$repo/.bench-ref/ref" --no-input -o "$work/ref-render"
  python3 -m pip install -q --no-deps --no-build-isolation --target "$work/ref-site" "$work/ref-render/ddp-project"
  paths[ref]=$work/ref-site:${PYTHONPATH#"$work/site:"}
  variants=(ref new)
fi
[[ ${sed_name:-} ]] && paths[$sed_name]=$sed_path
cd "$work"
logs=$work/logs
mkdir -p "$logs"
overrides=${OVERRIDES:-experiment=gpt2_small trainer.val_every=0}
: >"$OUT/startup.jsonl"
launch() {  # variant round kind run-dir overrides...
  local variant=$1 round=$2 kind=$3 run=$4
  shift 4
  local name=$variant-$round-$kind
  if (( SECONDS > stop_after )); then
    echo "STOP_AFTER_S=$stop_after: not starting $name"
    return
  fi
  rm -rf /tmp/torchinductor_"$(id -un)" "$HOME/.triton/cache"  # a fresh node
  local began
  began=$(date +%s.%N)
  # shellcheck disable=SC2086  # the overrides are words
  PYTHONPATH=${paths[$variant]} timeout "${LAUNCH_TIMEOUT:-200}" python3 -m ddp_project.launch train --standalone \
    --nproc-per-node 1 $overrides "$@" hydra.run.dir="$run" >"$logs/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$logs/$name.log"; }
  python3 - "$name" "$logs/$name.log" "$began" "$run" >>"$OUT/startup.jsonl" <<'PY'
import json, os, re, sys
name, log, began, run = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
text = open(log).read()
line = re.search(r"start-up ([\d.]+) s: (.*)", text)
first = re.search(r"the first step took ([\d.]+) s \(([^)]*)\)", text)
rows = [json.loads(l) for l in open(run + "/metrics.jsonl")] if os.path.exists(run + "/metrics.jsonl") else []
past = [r for r in rows if r["step"] > 20 and r.get("mfu")]
mfu = len(past) / sum(1 / r["mfu"] for r in past) if past else None  # over the windows' time
phases = dict((p.rsplit(" ", 2)[0], float(p.rsplit(" ", 2)[1])) for p in line[2].split(", ")) if line else {}
variant, round_, kind = name.split("-")
print(json.dumps({"name": name, "variant": variant, "round": int(round_), "kind": kind,
                  "start_up_s": float(line[1]) if line else None, "phases": phases,
                  "first_step_s": float(first[1]) if first else None, "compile": first[2] if first else None,
                  "to_first_step_s": (float(line[1]) + float(first[1])) if line and first else None,
                  "mfu": mfu, "mfu_windows": len(past)}))
PY
  grep -h "start-up\|first step took" "$logs/$name.log" | sed "s/^.*INFO\] - /$name: /"
}
compared=("${variants[@]}")  # ref and new: they alternate; a VARIANT_SED variant goes last
variants+=(${sed_name:+"$sed_name"})
for round in $(seq "${ROUNDS:-2}"); do
  order=("${compared[@]}")
  ((round % 2 == 0)) && order=($(printf '%s\n' "${compared[@]}" | tac))
  order+=(${sed_name:+"$sed_name"})
  for v in "${order[@]}"; do
    runs=/tmp/startup-runs/$v-$round
    rm -rf "$runs"
    cold=${COLD_STEPS:-2}
    launch "$v" "$round" cold "$runs/run" trainer.max_steps="$cold" trainer.checkpoint_every="$cold" \
      trainer.log_every=10
    launch "$v" "$round" resched "$runs/run" trainer.max_steps=$((cold + 2)) trainer.checkpoint_every=0
    if [[ ${RERUN:-1} == 1 ]]; then
      launch "$v" "$round" rerun "$runs/rerun" trainer.max_steps=2 trainer.checkpoint_every=0
    fi
  done
done
python3 - "$OUT/startup.jsonl" <<'PY' | tee "$OUT/startup.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
def launcher_s(r):  # the launcher's phases: one before its imports were timed apart, two since
    return r["phases"].get("launcher imports", 0) + r["phases"].get("launcher", 0)
print("launch            start-up  launcher (its imports)  imports  config  model  resume  first step  launch->first step done  compile")
for r in rows:
    p = r["phases"]
    print(f"{r['name']:17} {r['start_up_s'] or 0:8.1f} {launcher_s(r):9.1f} ({p.get('launcher imports', float('nan')):4.1f})"
          f"     {p.get('imports', 0):8.1f}"
          f" {p.get('config', 0):7.1f} {p.get('model', 0):6.1f} {p.get('resume', 0):7.1f} {r['first_step_s'] or 0:11.1f}"
          f" {r['to_first_step_s'] or 0:24.1f}  {r['compile']}")
print("\nmedian (min-max) over rounds: launch -> first step done; the launcher phase; the cold runs' MFU")
for kind in ("cold", "resched", "rerun"):
    for variant in dict.fromkeys(r["variant"] for r in rows):
        got = [r for r in rows if r["variant"] == variant and r["kind"] == kind and r["to_first_step_s"]]
        if got:
            total = [r["to_first_step_s"] for r in got]
            launchers = [launcher_s(r) for r in got]
            mfu = [r["mfu"] for r in got if r["mfu"]]
            print(f"{kind:8} {variant:6} {statistics.median(total):6.1f} ({min(total):.1f}-{max(total):.1f})"
                  f"   launcher {statistics.median(launchers):4.1f} ({min(launchers):.1f}-{max(launchers):.1f})"
                  + (f"   MFU {statistics.median(mfu):.4f} ({min(mfu):.4f}-{max(mfu):.4f})" if mfu else ""))
PY
tar czf "$OUT/startup-logs.tgz" -C "$logs" .
