#!/usr/bin/env bash
# Issue 34 on one GPU: the doctor; stops after 0, 1 and 2 resumes and during a compile
# (scripts/gpu-stop.py); Ctrl-C at moments of the launcher's start-up, seen from its stderr (one
# line, exit 130); 40 steps of gpt2_small, then evaluate of its checkpoint, which names the
# options that built it. Logs in $OUT.
#   scripts/fetch-gpu-wheels.sh   # once, here
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-day-one.sh
set -uo pipefail
source "$(dirname "$0")/gpu-setup.sh"
scripts=$(cd "$(dirname "$0")" && pwd)
cd "$work"
python3 -m ddp_project.doctor > "$OUT/doctor.txt" 2>&1
echo "GPU-RESULT doctor exit $?"
python3 "$scripts/gpu-stop.py" ddp_project 1 experiment=gpt2_small > "$OUT/stop.txt" 2>&1
echo "GPU-RESULT gpu-stop exit $?"; grep -E "GPU-RESULT|exit|stopped" "$OUT/stop.txt" | tail -8
# Ctrl-C to the launch's process group, as a terminal sends it, at fixed moments of a GPU start-up
# (an idle 16-core machine: the launcher imports torch, the worker imports, composes, compiles).
for t in 0.5 2 4 8 15; do
  setsid python3 -m ddp_project.launch train --nproc-per-node 1 experiment=gpt2_small \
    "hydra.run.dir=$work/ctrl-c-$t" > "$OUT/ctrl-c-$t.out" 2> "$OUT/ctrl-c-$t.err" & pid=$!
  sleep "$t"; kill -INT -- "-$pid"; wait "$pid"; code=$?
  lines=$(grep -cv '^\s*$' "$OUT/ctrl-c-$t.err"); tracebacks=$(grep -c Traceback "$OUT/ctrl-c-$t.err")
  echo "GPU-RESULT ctrl-c at ${t}s: exit $code, $lines stderr line(s), $tracebacks traceback(s): $(tail -1 "$OUT/ctrl-c-$t.err")"
done
python3 -m ddp_project.launch train --nproc-per-node 1 experiment=gpt2_small trainer.max_steps=40 \
  trainer.log_every=10 "hydra.run.dir=$work/run40" > "$OUT/train40.txt" 2>&1
echo "GPU-RESULT train 40 steps exit $?"; grep -E "step 40/40" "$OUT/train40.txt" | tail -1
python3 -c "import sys, torch; print('GPU-RESULT options', torch.load(sys.argv[1], weights_only=True)['options'])" "$work/run40/checkpoints/step_000000040.pt"
python3 -m ddp_project.evaluate "ckpt=$work/run40" > "$OUT/evaluate.txt" 2>&1
echo "GPU-RESULT evaluate exit $?"; tail -2 "$OUT/evaluate.txt"
