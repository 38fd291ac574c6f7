#!/usr/bin/env bash
# The GPU half of the template's tests, for a machine with >= 2 GPUs and no package registry:
# render the template, install the project non-editably, run its `gpu` tests from another
# directory (nccl=auto, nccl_default, pcie_safe with NCCL_DEBUG=INFO), then measure the
# all-reduce bus bandwidth under each profile's variables. Logs go to $OUT.
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
python3 -m pytest -m gpu -s -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu-tests.log"

cd "$work"
# What nccl=auto decides on this node, from the project's own probe and rules.
auto_env=$(WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 python3 -c '
from ddp_project import nccl, probe
from ddp_project.config import NcclConfig
facts = probe.probe_node()
decision = nccl.decide(NcclConfig(auto=True), facts, {})
print(decision.report(), file=__import__("sys").stderr)
print(" ".join(f"{k}={v}" for k, v in decision.env.items()))')
for profile in auto nccl_default pcie_safe socket; do
  case $profile in
    auto) read -ra vars <<< "$auto_env" ;;
    nccl_default) vars=() ;;
    pcie_safe) vars=(NCCL_P2P_DISABLE=1 NCCL_IB_DISABLE=1) ;;
    socket) vars=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1) ;;
  esac
  echo "== $profile ${vars[*]:-}"
  env "${vars[@]}" torchrun --standalone --nproc-per-node 2 "$template/scripts/allreduce_bw.py" 2>&1 | grep ALLREDUCE
done | tee "$OUT/allreduce.txt"
echo; grep -h "GPU-RESULT" "$OUT/gpu-tests.log"; tail -1 "$OUT/gpu-tests.log"; cat "$OUT/allreduce.txt"
