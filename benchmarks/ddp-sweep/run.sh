# One-off DDP knob sweeps behind BENCHMARKS.md (issue 5), kept verbatim. On the GPU machine, from the repo root:
#   bash benchmarks/ddp-sweep/run.sh all               # sweep.py: 1 GPU, then 2 GPUs
#   SWEEP=sweep2.py bash benchmarks/ddp-sweep/run.sh x  # sweep2.py: the second round
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 NCCL_IB_DISABLE=1
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm --format=csv | tee $OUT/sweep.log
torchrun --standalone --nproc-per-node 1 benchmarks/ddp-sweep/${SWEEP:-sweep.py} ${1:-all} 2>&1 | tee -a $OUT/sweep.log | grep -v "^SWEEP" | tail -5
torchrun --standalone --nproc-per-node 2 benchmarks/ddp-sweep/${SWEEP:-sweep.py} ${1:-all} 2>&1 | tee -a $OUT/sweep.log | grep -v "^SWEEP" | tail -5
grep "^SWEEP" $OUT/sweep.log | cut -c7- | python3 -c '
import sys, json
for l in sys.stdin:
    d = json.loads(l); print(d.get("world"), "%-32s" % d["name"], d.get("ms"), d.get("samples_s", d.get("busbw")), d.get("spread",""), d.get("warm_s",""), d.get("error",""))'
