#!/usr/bin/env bash
# Peak GPU memory on one GPU of a GPT larger than gpt2_small, per dist.strategy and
# dist.activation_checkpointing: which variants fit the GPU, at what peak and speed. A variant
# that runs out of memory says so ("out of memory") in the table. Rows in $OUT/memory.jsonl,
# table in $OUT/memory.log.
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-memory.sh [NAME:OVERRIDES ...]
# Without arguments: GPT-2 XL's shape (48 blocks, width 1600, 25 heads: 1.6B parameters) at
# gpt2_small's batch (32 x 1024 tokens), eager: DDP without activation checkpointing, then DDP and
# FSDP2 with it.
set -uo pipefail
source "$(dirname "$0")/gpu-setup.sh"
cd "$work"
steps=${STEPS:-8}
variants=("$@")
if [[ ${#variants[@]} == 0 ]]; then
  xl="experiment=gpt2_small model.n_layer=48 model.d_model=1600 model.n_head=25 trainer.compile=false"
  variants=("ddp:$xl" "ddp-ac:$xl dist.activation_checkpointing=true"
            "fsdp2-ac:$xl dist.activation_checkpointing=true dist.strategy=fsdp2 trainer.checkpoint_format=dcp")
fi
: >"$OUT/memory.jsonl"
for variant in "${variants[@]}"; do
  name=${variant%%:*}
  run=$work/runs/$name
  # shellcheck disable=SC2086  # the overrides are words
  timeout "${LAUNCH_TIMEOUT:-400}" python3 -m ddp_project.launch train --standalone --nproc-per-node 1 ${variant#*:} \
    trainer.max_steps="$steps" trainer.log_every=2 trainer.checkpoint_every=0 trainer.val_every=0 \
    hydra.run.dir="$run" >"$OUT/$name.log" 2>&1
  rc=$?
  python3 - "$run/metrics.jsonl" "$OUT/$name.log" "$name" "$rc" >>"$OUT/memory.jsonl" <<'PY'
import json, sys
metrics, log, name, rc = sys.argv[1:]
try:
    rows = [json.loads(line) for line in open(metrics)]
except OSError:
    rows = []
text = open(log, errors="replace").read()
last = rows[-1] if rows else {}
print(json.dumps({"variant": name, "rc": int(rc), "oom": "out of memory" in text.lower(),
                  **{k: last.get(k) for k in ("step", "peak_memory_gib", "mfu", "step_time_ms")}}))
PY
done
python3 - "$OUT/memory.jsonl" <<'PY' | tee "$OUT/memory.log"
import json, sys
print("variant          rc  result          step  peak GiB    MFU  ms/step")
for r in map(json.loads, open(sys.argv[1])):
    result = "out of memory" if r["oom"] else ("ok" if r["rc"] == 0 else "failed")
    def fmt(key, spec):
        return format(r[key], spec) if r[key] is not None else "-"
    print(f"{r['variant']:16} {r['rc']:>3}  {result:14} {fmt('step', '>5')} {fmt('peak_memory_gib', '>9.1f')}"
          f" {fmt('mfu', '>6.3f')} {fmt('step_time_ms', '>8.0f')}")
PY
