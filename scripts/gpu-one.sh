#!/usr/bin/env bash
# What a one-GPU node gives (num_gpus=1 is a supported answer), for a machine with >= 1 GPU and no
# package registry: the doctor (nothing between GPUs to test: one process's NCCL init per
# profile), then stop signals on the GPU after 0, 1 and 2 resumes (scripts/gpu-stop.py). Logs in $OUT.
#   scripts/fetch-gpu-wheels.sh   # once, here
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-one.sh
set -uo pipefail
source "$(dirname "$0")/gpu-setup.sh"
scripts=$(cd "$(dirname "$0")" && pwd)
cd "$work"
python3 -m ddp_project.doctor 2>&1 | tee "$OUT/doctor.txt"
echo "GPU-RESULT doctor exit ${PIPESTATUS[0]}" | tee -a "$OUT/doctor.txt"
# shellcheck disable=SC2086  # STOP_OVERRIDES are words, e.g. experiment=gpt2_small (compiled)
python3 "$scripts/gpu-stop.py" ddp_project "${NPROC:-1}" ${STOP_OVERRIDES:-} 2>&1 | tee "$OUT/stop.txt"
echo "GPU-RESULT gpu-stop exit ${PIPESTATUS[0]}"
