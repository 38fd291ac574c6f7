#!/usr/bin/env bash
# MFU, tokens/s and peak memory of the generated project on one GPU, as the log line and
# metrics.jsonl give them, for variants interleaved round by round in one invocation (the
# machines drift between launches). Each run's windows after the first 20 steps (warm-up,
# compilation) count, all of them: a run's MFU and tokens/s are its tokens over its time in those
# windows (a stall in one window counts), then the median over ROUNDS rounds (default 3) and their
# min-max. "slowest window" is the lowest window MFU of any round: a stall the median hides.
# Each launch is a fresh node with runs of its own (/tmp's caches emptied, no .compile-cache beside
# it): its first step, compile included, is a cold one, in the table too.
# VARIANT_SED="NAME|FILE|EXPRESSION": variant NAME runs a copy of the package with the sed
# EXPRESSION applied to FILE (a path in the package), e.g. the model compiled whole:
#   VARIANT_SED="whole|run/compilation.py|s/regions = repeated_blocks(bare)/regions = []/"
# Rows in $OUT/mfu.jsonl, table in $OUT/mfu.log, the launches' logs in $OUT/logs.tgz. STOP_AFTER_S:
# no launch starts after that many seconds of the script, set-up included; one that started runs
# on (up to 400 s), so leave a launch's length between it and the device call's limit.
#   scripts/fetch-gpu-wheels.sh   # once, here
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-mfu.sh [NAME:OVERRIDES ...]
# Without arguments: gpt2_small eager and compiled, and mlp_134m. With them, e.g.
#   bash scripts/gpu-mfu.sh "b8:experiment=gpt2_small" "b32:experiment=gpt2_small data.batch_size=32"
set -uo pipefail
stop_after=${STOP_AFTER_S:-86400}
if [[ ! $stop_after =~ ^(0|[1-9][0-9]*)$ ]]; then  # before the set-up spends device time
  echo "STOP_AFTER_S=$stop_after: a whole number of seconds" >&2
  exit 2
fi
source "$(dirname "$0")/gpu-setup.sh"
cd "$work"
declare -A sites=()
[[ ${sed_name:-} ]] && sites[$sed_name]=$sed_path
rounds=${ROUNDS:-3}
steps=${STEPS:-80}
variants=("$@")
if [[ ${#variants[@]} == 0 ]]; then
  variants=("gpt2-eager:experiment=gpt2_small trainer.compile=false" "gpt2-compiled:experiment=gpt2_small"
            "mlp-eager:experiment=mlp_134m")
fi
names=()
declare -A overrides=()
for variant in "${variants[@]}"; do
  names+=("${variant%%:*}")
  overrides[${variant%%:*}]=${variant#*:}
done
: >"$OUT/mfu.jsonl"
for round in $(seq "$rounds"); do
  for name in "${names[@]}"; do
    if (( SECONDS > stop_after )); then  # a device call's limit: keep what ran
      echo "STOP_AFTER_S=$stop_after: not starting $name round $round"
      break 2
    fi
    run=$work/runs/$name-$round/run  # its own .compile-cache beside it
    rm -rf /tmp/torchinductor_"$(id -un)" "$HOME/.triton/cache"  # a fresh node
    # shellcheck disable=SC2086  # the overrides are words
    PYTHONPATH=${sites[$name]:-$PYTHONPATH} timeout 400 python3 -m ddp_project.launch train --standalone --nproc-per-node 1 ${overrides[$name]} \
      trainer.max_steps="$steps" trainer.log_every=10 trainer.checkpoint_every=0 hydra.run.dir="$run" \
      >"$work/$name-$round.log" 2>&1 || { echo "$name round $round failed:"; tail -5 "$work/$name-$round.log"; }
    grep -h "MFU" "$work/$name-$round.log" | tail -1
    first=$(grep -ho "the first step took [0-9.]* s" "$work/$name-$round.log" | grep -o "[0-9.]* s" | head -1)
    python3 -c 'import json,sys; [print(json.dumps({**json.loads(l), "variant": sys.argv[2], "round": int(sys.argv[3]), "first_step_s": float(sys.argv[4] or "nan")})) for l in open(sys.argv[1])]' \
      "$run/metrics.jsonl" "$name" "$round" "${first% s}" >>"$OUT/mfu.jsonl" 2>/dev/null
  done
done
python3 - "$OUT/mfu.jsonl" <<'PY' | tee "$OUT/mfu.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("variant          rounds  MFU median (min-max)    tokens/s median      ms/step   slowest window   peak GiB   cold first step s")
for variant in dict.fromkeys(r["variant"] for r in rows):
    per_round = {}
    for r in rows:
        if r["variant"] == variant and r["step"] > 20:
            per_round.setdefault(r["round"], []).append(r)
    if not per_round:
        print(f"{variant:16} no windows past step 20")
        continue
    def over_time(key):  # windows of equal steps: the rate over their time is the harmonic mean
        rates = [[x[key] for x in rs if x.get(key)] for rs in per_round.values()]
        return [len(r) / sum(1 / v for v in r) for r in rates if r] or [float("nan")]
    mfu, tok = over_time("mfu"), over_time("tokens_per_s")  # nan: not known (a CPU, a MIG slice)
    ms = [statistics.mean(x["step_time_ms"] for x in rs) for rs in per_round.values()]
    slowest = min((x["mfu"] for rs in per_round.values() for x in rs if x.get("mfu")), default=float("nan"))
    peak = max(x["peak_memory_gib"] or 0 for rs in per_round.values() for x in rs)
    first = [rs[0].get("first_step_s", float("nan")) for rs in per_round.values()]
    print(f"{variant:16} {len(ms):>6}  {statistics.median(mfu):.3f} ({min(mfu):.3f}-{max(mfu):.3f})"
          f"    {statistics.median(tok):>12,.0f}   {statistics.median(ms):8.1f}   {slowest:14.3f}   {peak:8.1f}"
          f"   {statistics.median(first):.1f} ({min(first):.1f}-{max(first):.1f})")
PY
summary=$?
shopt -s nullglob
logs=(./*.log)  # in $work
if (( ${#logs[@]} )); then
  tar czf "$OUT/logs.tgz" "${logs[@]}"
fi
exit "$summary"
