"""All-reduce bus bandwidth, one process per GPU, as nccl-tests' all_reduce_perf reports it.

    torchrun --standalone --nproc-per-node 2 scripts/allreduce_bw.py

Bus bandwidth = bytes / time * 2 * (n - 1) / n. The NCCL_* environment is taken as given.
"""

import json
import os
import time

import torch
import torch.distributed as dist

SIZES_MIB = [1, 64, 1024]


def bus_bandwidth(nbytes: int, seconds: float, world: int) -> float:
    return nbytes / seconds * 2 * (world - 1) / world / 1e9


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    started = time.perf_counter()
    dist.init_process_group("nccl", device_id=device)
    dist.all_reduce(torch.ones(1, device=device))
    torch.cuda.synchronize()
    init_s = time.perf_counter() - started
    world = dist.get_world_size()
    result = {"init_s": round(init_s, 2), "busbw_gbps": {}}
    for mib in SIZES_MIB:
        tensor = torch.ones(mib * 2**20 // 4, device=device)
        iters = 20 if mib < 1024 else 10
        for _ in range(5):
            dist.all_reduce(tensor)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / iters
        result["busbw_gbps"][f"{mib}MiB"] = round(bus_bandwidth(tensor.nbytes, seconds, world), 1)
    if dist.get_rank() == 0:
        print("ALLREDUCE " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
