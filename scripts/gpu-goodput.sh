#!/usr/bin/env bash
# Goodput of the generated project on one GPU: checkpoints written in the background
# (trainer.async_checkpoint=true, the default) against waiting for each write (false), interleaved
# A B B A ... in one invocation, after one cold launch that compiles (its start-up is reported).
# Per launch: the checkpoint stall (metrics' checkpoint_s over the checkpoints it wrote), the
# steady-state overhead of checkpoints and validation against step time, the slowest log window
# past warm-up against the median (a background write that slows the steps shows there), and the
# goodput line train prints at its end; then the last background-write run resumed for 100 steps
# (start-up and first step: a rescheduled pod, nothing in /tmp, the caches beside the run). Rows in $OUT/goodput.jsonl, table in $OUT/goodput.log.
#   scripts/fetch-gpu-wheels.sh   # once, here
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-goodput.sh
# PAIRS (default 2), STEPS (default 400) and OVERRIDES (default experiment=gpt2_small) narrow it;
# LONG=3000 runs the long pair instead (cold, then warm from the caches beside the run; COLD_STEPS
# shortens the cold one).
# COMPARE=format compares trainer.checkpoint_format=file against dcp instead (both in the
# background), and resumes the last run of each (the start-up line's resume phase: the load).
set -uo pipefail
source "$(dirname "$0")/gpu-setup.sh"
cd "$work"
pairs=${PAIRS:-2}
steps=${STEPS:-400}
overrides=${OVERRIDES:-experiment=gpt2_small}
runs=/tmp/goodput-runs  # 2 GB checkpoints: not under $OUT
rm -rf "$runs"
: >"$OUT/goodput.jsonl"
launch() {  # name run-dir overrides...
  local name=$1 run=$2
  shift 2
  # A fresh node: nothing in /tmp; the compile caches only where the run keeps them, beside it.
  rm -rf /tmp/torchinductor_"$(id -un)" "$HOME/.triton/cache"
  # shellcheck disable=SC2086  # the overrides are words
  timeout "${LAUNCH_TIMEOUT:-500}" python3 -m ddp_project.launch train --standalone --nproc-per-node 1 $overrides "$@" \
    hydra.run.dir="$run" >"$OUT/$name.log" 2>&1 || { echo "$name failed:"; tail -5 "$OUT/$name.log"; }
  grep -h "goodput\|waited" "$OUT/$name.log" | sed "s/^/$name: /"
  python3 - "$run" "$name" "$OUT/$name.log" >>"$OUT/goodput.jsonl" <<'PY'
import json, re, statistics, sys
run, name, log = sys.argv[1:]
rows = [json.loads(line) for line in open(f"{run}/metrics.jsonl")]
text = open(log).read()
written = len(re.findall(r"checkpoint checkpoints/step_", text))
good = re.search(r"goodput ([\d.]+): ([\d.]+) s of steps in ([\d.]+) s since launch \((.*?)\)(?:; effective MFU ([\d.]+))?", text)
first = re.search(r"the first step took ([\d.]+) s", text)
resume = re.search(r"start-up [\d.]+ s: .*?resume ([\d.]+) s", text)
waited = sum(float(s) for s in re.findall(r"waited ([\d.]+) s for the write", text))
past = [r for r in rows if r["step"] > 20]
windows = [r["step_time_ms"] for r in past]
stepping, before = 0.0, 0
for r in rows:  # a window's steps at its step time (the first step, set aside, at the same)
    stepping, before = stepping + r["step_time_ms"] / 1e3 * (r["step"] - before), r["step"]
print(json.dumps({
    "name": name, "checkpoints": written,
    "checkpoint_s": sum(r["checkpoint_s"] or 0 for r in rows),
    "val_s": sum(r["val_time_s"] or 0 for r in rows),
    "stepping_s": stepping,
    "median_ms": statistics.median(windows) if windows else None,
    "slowest_ms": max(windows) if windows else None,
    "mfu": statistics.median(r["mfu"] for r in past) if past and past[0]["mfu"] else None,
    "goodput": float(good[1]) if good else None, "wall_s": float(good[3]) if good else None,
    "lost": good[4] if good else None, "effective_mfu": float(good[5]) if good and good[5] else None,
    "first_step_s": float(first[1]) if first else None,
    "resume_s": float(resume[1]) if resume else None, "waited_s": waited,
}))
PY
}
if [[ ${LONG:-} ]]; then
  # The issue's target: a run of LONG steps with the defaults, cold (nothing cached anywhere), then
  # again in a new run dir with an empty /tmp and the first run's compile caches beside it.
  # COLD_STEPS shortens the cold run (default LONG): a few steps compile, validate and checkpoint
  # as the long run does, so that the warm one finds all of its graphs.
  launch cold-long "$runs/cold-long" trainer.max_steps="${COLD_STEPS:-$LONG}"
  rm -rf "$runs/cold-long/checkpoints"
  launch warm-long "$runs/warm-long" trainer.max_steps="$LONG"
  pairs=0
else
  launch cold "$runs/cold" trainer.max_steps=2 trainer.checkpoint_every=0 trainer.val_every=0
fi
variants=(async sync)
[[ ${COMPARE:-} == format ]] && variants=(file dcp)
setting() {  # variant -> its override
  case $1 in
    async) echo trainer.async_checkpoint=true ;;
    sync) echo trainer.async_checkpoint=false ;;
    *) echo trainer.checkpoint_format="$1" ;;
  esac
}
for pair in $(seq "$pairs"); do
  order=("${variants[@]}")
  ((pair % 2 == 0)) && order=("${variants[1]}" "${variants[0]}")
  for variant in "${order[@]}"; do
    launch "$variant-$pair" "$runs/$variant-$pair" trainer.max_steps="$steps" "$(setting "$variant")"
    [[ $variant != sync && $pair == "$pairs" ]] || rm -rf "$runs/$variant-$pair/checkpoints"
  done
done
# A rescheduled pod: the last run resumed for 100 more steps, from its checkpoint and caches (each
# format's, comparing formats).
if ((pairs)); then
  for variant in "${variants[@]}"; do
    [[ $variant == sync ]] && continue
    launch "resume-$variant" "$runs/$variant-$pairs" trainer.max_steps=$((steps + 100)) "$(setting "$variant")"
  done
fi
python3 - "$OUT/goodput.jsonl" <<'PY' | tee "$OUT/goodput.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'launch':12} {'ckpts':>5} {'stall/ckpt s':>12} {'ckpt+val/steps':>14} {'median ms':>9} {'slowest ms':>10} {'MFU':>6} {'goodput':>7} {'wall s':>7} {'eff MFU':>7} {'1st step s':>10} {'resume s':>8} {'waited s':>8}")
for r in rows:
    stall = r["checkpoint_s"] / r["checkpoints"] if r["checkpoints"] else float("nan")
    over = (r["checkpoint_s"] + r["val_s"]) / r["stepping_s"] if r["stepping_s"] else float("nan")
    f = lambda v, spec: format(v, spec) if isinstance(v, (int, float)) else "-"
    print(f"{r['name']:12} {r['checkpoints']:5d} {stall:12.3f} {over:14.3f} {f(r['median_ms'], '9.1f')} {f(r['slowest_ms'], '10.1f')} {f(r['mfu'], '6.3f')} {f(r['goodput'], '7.3f')} {f(r['wall_s'], '7.1f')} {f(r['effective_mfu'], '7.3f')} {f(r['first_step_s'], '10.1f')} {f(r.get('resume_s'), '8.1f')} {f(r.get('waited_s'), '8.1f')}")
    print(f"{'':12} lost: {r['lost']}")
for variant in ("async", "sync", "file", "dcp"):
    mine = [r for r in rows if r["name"].startswith(variant + "-")]
    if mine:
        stall = [r["checkpoint_s"] / r["checkpoints"] for r in mine if r["checkpoints"]]
        good = [r["goodput"] for r in mine if r["goodput"]]
        print(f"{variant}: stall/ckpt median {statistics.median(stall):.3f} s ({min(stall):.3f}-{max(stall):.3f}), goodput median {statistics.median(good):.3f} ({min(good):.3f}-{max(good):.3f})")
PY
