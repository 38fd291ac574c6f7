"""All-reduce bus bandwidth under the NCCL environment given, as nccl-tests' all_reduce_perf
reports it: bytes / time * 2 * (n - 1) / n. One process per GPU; gloo on CPU without CUDA.

    torchrun --standalone --nproc-per-node 2 -m {{ cookiecutter.package }}.nccl.allreduce --sizes-mib 1 64 1024

Rank 0 prints one line, `ALLREDUCE {json}`: init seconds (init_process_group and a first
all-reduce) and GB/s per size. The doctor runs this once per NCCL profile.
"""  # noqa: E501

import argparse
import json
import time

import torch
import torch.distributed as dist

from ..core.world import World
from . import process_group

MIB = 2**20
MIN_TIMED_S = 0.3  # per size: enough iterations to smooth launch jitter, few enough to be quick


def bus_bandwidth_gbps(nbytes: int, seconds: float, world_size: int) -> float:
    return nbytes / seconds * 2 * (world_size - 1) / world_size / 1e9


def time_all_reduce(tensor: torch.Tensor, iterations: int) -> float:
    """Seconds per all-reduce, averaged over `iterations` back-to-back calls."""
    sync = torch.cuda.synchronize if tensor.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(tensor)
    sync()
    return (time.perf_counter() - start) / iterations


def measure(sizes_mib: list[int], device: torch.device) -> dict[str, float]:
    world = dist.get_world_size()
    results = {}
    for mib in sizes_mib:
        tensor = torch.ones(mib * MIB // 4, device=device)
        first = time_all_reduce(tensor, 2)  # warm-up, and a guide to how many iterations fit
        iterations = torch.tensor(
            [max(3, min(50, int(MIN_TIMED_S / max(first, 1e-6))))], device=device
        )
        dist.all_reduce(iterations, op=dist.ReduceOp.MIN)  # every rank must run the same count
        seconds = time_all_reduce(tensor, int(iterations.item()))
        results[f"{mib}MiB"] = round(bus_bandwidth_gbps(tensor.nbytes, seconds, world), 2)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    # none: init and the check all-reduce only (one process moves nothing between GPUs)
    parser.add_argument("--sizes-mib", type=int, nargs="*", default=[1, 64, 1024])
    args = parser.parse_args()
    world = World.from_env()
    device = process_group.select_device(torch.cuda.is_available(), world)
    started = time.perf_counter()
    # torch's default timeout: the doctor's own bounds the run; a failed all-reduce is reported as
    # such, not turned into a hang by destroying its communicator
    with process_group.initialized(world, device, destroy_on_error=False):
        check = torch.full((1024,), float(dist.get_rank() + 1), device=device)
        dist.all_reduce(check)
        size = dist.get_world_size()
        if not bool((check == size * (size + 1) / 2).all()):
            raise SystemExit("all-reduce returned wrong values: data corruption")
        init_s = time.perf_counter() - started
        busbw = measure(args.sizes_mib, device) if size > 1 else {}
        if dist.get_rank() == 0:
            result = {
                "backend": dist.get_backend(),
                "world_size": size,
                "init_s": round(init_s, 3),  # a one-process gloo init can take under 5 ms
                "busbw_gbps": busbw,
            }
            print("ALLREDUCE " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
