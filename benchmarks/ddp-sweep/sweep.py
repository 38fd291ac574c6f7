"""DDP knob sweep for a 134M MLP (8 x Linear 4096 + GELU), bf16 autocast, AdamW.
torchrun --nproc-per-node N explore/sweep.py  -> prints SWEEP json lines on rank 0."""
import json, os, time, statistics, sys
import torch, torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

rank = int(os.environ["RANK"]); world = int(os.environ["WORLD_SIZE"]); local = int(os.environ["LOCAL_RANK"])
dev = torch.device("cuda", local); torch.cuda.set_device(dev)
dist.init_process_group("nccl", device_id=dev)
WIDTH, DEPTH, CLASSES = 4096, 8, 8

def mlp():
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)

def run(name, batch=256, ddp=True, bucket=25, gav=False, static=False, hook=None, fused=False,
        compile_=False, accum=1, nosync=False, steps=30, blocks=3, warm=15, overlap_opt=False):
    torch.manual_seed(0)
    module = mlp().to(dev)
    model = module
    if ddp:
        model = DDP(module, device_ids=[local], bucket_cap_mb=bucket, gradient_as_bucket_view=gav, static_graph=static)
        if hook == "bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif hook == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if overlap_opt:
        model._register_fused_optim(torch.optim.AdamW, lr=1e-4, fused=True)
        opt = None
    else:
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4, fused=fused or None)
    fwd = torch.compile(model) if compile_ else model
    xs = [torch.randn(batch, WIDTH, device=dev) for _ in range(4)]
    ys = [torch.randint(0, CLASSES, (batch,), device=dev) for _ in range(4)]
    import contextlib
    def step(i):
        for micro in range(accum):
            ctx = model.no_sync() if ddp and (nosync or micro < accum - 1) else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(fwd(xs[(i + micro) % 4]), ys[(i + micro) % 4])
                loss.backward()
        if opt:
            opt.step(); opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    for i in range(warm):
        step(i)
    torch.cuda.synchronize(); warm_s = time.perf_counter() - t0
    times = []
    for b in range(blocks):
        dist.barrier(); torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(steps):
            step(i)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / steps)
    ms = statistics.median(times) * 1e3
    # the slowest rank decides
    t = torch.tensor([ms], device=dev); dist.all_reduce(t, op=dist.ReduceOp.MAX); ms = t.item()
    samples = batch * accum * world / (ms / 1e3)
    if rank == 0:
        print("SWEEP " + json.dumps({"world": world, "name": name, "batch": batch, "accum": accum, "ms": round(ms, 3),
              "spread": round((max(times) - min(times)) * 1e3, 3), "samples_s": round(samples), "warm_s": round(warm_s, 1),
              "params_M": round(sum(p.numel() for p in module.parameters()) / 1e6, 1)}), flush=True)
    del model, module, opt, fwd
    torch.cuda.synchronize(); torch.cuda.empty_cache()

def comm():
    for mib, dtype in ((512, torch.float32), (256, torch.bfloat16), (25, torch.float32), (100, torch.float32)):
        x = torch.ones(mib * 2**20 // (4 if dtype == torch.float32 else 2), dtype=dtype, device=dev)
        for _ in range(3): dist.all_reduce(x)
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(20): dist.all_reduce(x)
        torch.cuda.synchronize(); s = (time.perf_counter() - t) / 20
        if rank == 0:
            print("SWEEP " + json.dumps({"world": world, "name": f"allreduce {mib}MiB {dtype}", "ms": round(s * 1e3, 3),
                  "busbw": round(x.nbytes / s * 2 * (world - 1) / world / 1e9, 1)}), flush=True)

which = sys.argv[1] if len(sys.argv) > 1 else "all"
V = []
if world == 1:
    V += [("plain", dict(ddp=False)), ("plain fused", dict(ddp=False, fused=True)),
          ("ddp1 fused", dict(fused=True)), ("ddp1 fused gav static", dict(fused=True, gav=True, static=True)),
          ("plain fused b512", dict(ddp=False, fused=True, batch=512)), ("plain fused b1024", dict(ddp=False, fused=True, batch=1024)),
          ("plain fused accum2", dict(ddp=False, fused=True, accum=2)), ("plain fused accum4", dict(ddp=False, fused=True, accum=4))]
    if which == "all":
        V += [("plain fused compile", dict(ddp=False, fused=True, compile_=True))]
    V += [("plain again", dict(ddp=False))]
else:
    comm()
    V += [("ddp default", dict()), ("fused", dict(fused=True)), ("fused gav", dict(fused=True, gav=True)),
          ("fused gav static", dict(fused=True, gav=True, static=True)),
          ("fused gav static b50", dict(fused=True, gav=True, static=True, bucket=50)),
          ("fused gav static b100", dict(fused=True, gav=True, static=True, bucket=100)),
          ("fused gav static b10", dict(fused=True, gav=True, static=True, bucket=10)),
          ("fused gav bf16", dict(fused=True, gav=True, hook="bf16")),
          ("fused gav static bf16", dict(fused=True, gav=True, static=True, hook="bf16")),
          ("fused gav static bf16 b50", dict(fused=True, gav=True, static=True, hook="bf16", bucket=50)),
          ("fused gav static bf16 b100", dict(fused=True, gav=True, static=True, hook="bf16", bucket=100)),
          ("fused gav static bf16 b10", dict(fused=True, gav=True, static=True, hook="bf16", bucket=10)),
          ("fused gav static nosync", dict(fused=True, gav=True, static=True, nosync=True)),
          ("overlap_opt", dict(gav=True, overlap_opt=True)),
          ("fused gav static bf16 b512", dict(fused=True, gav=True, static=True, hook="bf16", batch=512)),
          ("fused gav static b512", dict(fused=True, gav=True, static=True, batch=512)),
          ("fused gav static bf16 b1024", dict(fused=True, gav=True, static=True, hook="bf16", batch=1024)),
          ("fused gav static b1024", dict(fused=True, gav=True, static=True, batch=1024)),
          ("fused gav static accum2", dict(fused=True, gav=True, static=True, accum=2)),
          ("fused gav static bf16 accum2", dict(fused=True, gav=True, static=True, hook="bf16", accum=2)),
          ("fused gav static accum4", dict(fused=True, gav=True, static=True, accum=4))]
    if which == "all":
        V += [("fused gav bf16 compile", dict(fused=True, gav=True, hook="bf16", compile_=True))]
    V += [("ddp default again", dict())]
for name, kw in V:
    try:
        run(name, **kw)
    except Exception as e:
        if rank == 0: print("SWEEP " + json.dumps({"world": world, "name": name, "error": repr(e)[:300]}), flush=True)
dist.destroy_process_group()
