#!/usr/bin/env bash
# The GPU half of the template's tests, for a machine with >= 2 GPUs and no package registry:
# render the template, install the project non-editably, run its `gpu` tests from another
# directory: training under nccl=auto, nccl_default and pcie_safe with NCCL_DEBUG=INFO, the
# doctor (its report is printed), a hung rank, and stop signals under a compiled model. Logs go to $OUT.
#   scripts/fetch-gpu-wheels.sh   # once, here: hydra, omegaconf, cookiecutter, tensorboard, matplotlib as wheels in .whl/
#   device run (kind nvidia-h200-x2, carry .whl):  bash scripts/gpu-e2e.sh
set -euo pipefail
scripts=$(cd "$(dirname "$0")" && pwd)
source "$scripts/gpu-setup.sh"

cd "$project"
# GPU_TESTS narrows the run (pytest -k), e.g. GPU_TESTS="not doctor" when device time is short.
python3 -m pytest -n 0 -m gpu -k "${GPU_TESTS:-}" -s -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log"
# Preemption on GPUs: SIGTERM to torchrun, a checkpoint at the stopping step, a resume.
python3 -m pytest -n 0 -q -p no:cacheprovider tests/test_resume.py -k sigterm 2>&1 | tee -a "$OUT/gpu-tests.log"
# The same compiled, under DDP on 2 GPUs (experiment=gpt2_small): stops after 0, 1 and 2 resumes
# with a checkpoint at the stopping step, and one while the first step after a resume compiles.
set +e
python3 "$scripts/gpu-stop.py" ddp_project 2 experiment=gpt2_small 2>&1 | tee -a "$OUT/gpu-tests.log"
echo "GPU-RESULT gpu-stop compiled exit ${PIPESTATUS[0]}" | tee -a "$OUT/gpu-tests.log"
set -e
echo; grep -h "GPU-RESULT" "$OUT/gpu-tests.log"; tail -1 "$OUT/gpu-tests.log"
