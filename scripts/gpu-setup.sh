# Sourced by the GPU scripts: the environment, then the template rendered and the project
# installed non-editably (no registry needed). Sets $work and $project. GC_PROBE=1: each
# Python process prints a line per full garbage collection (scripts/gc-probe/sitecustomize.py).
# VARIANT_SED="NAME|FILE|EXPRESSION": a copy of the installed package with the sed EXPRESSION
# applied to ddp_project/FILE, for a script to run beside this tree's; sets $sed_name and
# $sed_path (its PYTHONPATH). An expression that changes nothing stops the script (exit 2).
# NVLink multicast must stay off on the shared GPU hosts.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ ${GC_PROBE:-} == 1 ]]; then  # every Python process logs its full collections (gc-probe/)
  probe=$(CDPATH='' cd -- "$(dirname "${BASH_SOURCE[0]}")" && pwd)/gc-probe
  export PYTHONPATH=$probe${PYTHONPATH:+:$PYTHONPATH}
fi
work=$(mktemp -d)
python3 -m cookiecutter "$PWD" --no-input -o "$work/render"
project=$work/render/ddp-project
python3 -m pip install -q --no-deps --no-build-isolation --target "$work/site" "$project"
export PYTHONPATH=$work/site:$PYTHONPATH
if [[ ${VARIANT_SED:-} ]]; then
  IFS='|' read -r sed_name sed_file sed_expression <<<"$VARIANT_SED"
  cp -r "$work/site" "$work/site-$sed_name"
  sed -i "$sed_expression" "$work/site-$sed_name/ddp_project/$sed_file"
  if cmp -s "$work/site/ddp_project/$sed_file" "$work/site-$sed_name/ddp_project/$sed_file"; then
    echo "VARIANT_SED: the expression changed nothing in $sed_file" >&2
    exit 2
  fi
  sed_path=$work/site-$sed_name:${PYTHONPATH#"$work/site:"}
fi
{
  nvidia-smi --query-gpu=index,name,driver_version --format=csv
  nvidia-smi topo -m
  python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'
} 2>&1 | tee "$OUT/machine.txt"
