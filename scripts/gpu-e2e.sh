#!/usr/bin/env bash
# The GPU half of the template's tests, for a machine with >= 2 GPUs and no package registry:
# render the template, install the project non-editably, run its `gpu` tests from another
# directory: training under nccl=auto, nccl_default and pcie_safe with NCCL_DEBUG=INFO, the
# doctor (its report is printed), and a hung rank. Logs go to $OUT.
#   ../shared/device/fetch-wheels.sh   # once, here: hydra, omegaconf, cookiecutter as wheels in .whl/
#   device run (kind nvidia-h200-x2, carry .whl):  bash scripts/gpu-e2e.sh
set -euo pipefail
OUT=${OUT:-/tmp/gpu-e2e}
mkdir -p "$OUT"
# NVLink multicast must stay off on the shared GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
template=$PWD
work=$(mktemp -d)
python3 -m cookiecutter "$template" --no-input -o "$work/render"
python3 -m pip install -q --no-deps --no-build-isolation --target "$work/site" "$work/render/ddp-project"
export PYTHONPATH=$work/site:$PYTHONPATH
{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} 2>&1 | tee "$OUT/machine.txt"

cd "$work/render/ddp-project"
# GPU_TESTS narrows the run (pytest -k), e.g. GPU_TESTS="not doctor" when device time is short.
python3 -m pytest -m gpu -k "${GPU_TESTS:-}" -s -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log"
# Preemption on GPUs: SIGTERM to torchrun, a checkpoint at the stopping step, a resume.
python3 -m pytest -q -p no:cacheprovider tests/test_resume.py -k sigterm 2>&1 | tee -a "$OUT/gpu-tests.log"
echo; grep -h "GPU-RESULT" "$OUT/gpu-tests.log"; tail -1 "$OUT/gpu-tests.log"
