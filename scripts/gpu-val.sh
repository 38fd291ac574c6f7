#!/usr/bin/env bash
# Validation while training on one GPU (issue 24): gpt2_small for 600 steps with a validation
# every 50, its figures against evaluate's on the same checkpoints (the last and best.pt), and a
# SIGTERM during a validation. Logs in $OUT (scripts/gpu-val.py says what each part prints).
#   scripts/fetch-gpu-wheels.sh   # once, here
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-val.sh
set -uo pipefail
source "$(dirname "$0")/gpu-setup.sh"
scripts=$(cd "$(dirname "$0")" && pwd)
cd "$work"
python3 "$scripts/gpu-val.py" "$work" 2>&1 | tee "$OUT/gpu-val.txt"
