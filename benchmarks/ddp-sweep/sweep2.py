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
_a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
_t = time.perf_counter()
while time.perf_counter() - _t < 4:
    _a @ _a
torch.cuda.synchronize(); del _a

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
        if overlap_opt:
            pass
        elif hook == "bf16":
            model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif hook == "fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if overlap_opt:
        opts = {}
        hook_kind = hook
        def overlap_hook(state, bucket):
            params = bucket.parameters()
            if hook_kind == "bf16":
                fut = default_hooks.bf16_compress_hook(None, bucket)
            else:
                fut = default_hooks.allreduce_hook(None, bucket)
            def step(f):
                value = f.value()
                key = tuple(id(p) for p in params)
                opt = opts.get(key)
                if opt is None:
                    opt = opts[key] = torch.optim.AdamW(params, lr=1e-4, fused=True)
                if not gav:
                    for p, g in zip(params, bucket.gradients()):
                        p.grad = g
                opt.step()
                return value
            return fut.then(step)
        model.register_comm_hook(None, overlap_hook)
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
        elif overlap_opt:
            for p in module.parameters():
                p.grad = None
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
    with torch.no_grad():
        checksum = sum(p.double().sum().item() for p in module.parameters())
    # the slowest rank decides
    t = torch.tensor([ms], device=dev); dist.all_reduce(t, op=dist.ReduceOp.MAX); ms = t.item()
    samples = batch * accum * world / (ms / 1e3)
    if rank == 0:
        print("SWEEP " + json.dumps({"world": world, "name": name, "batch": batch, "accum": accum, "ms": round(ms, 3),
              "spread": round((max(times) - min(times)) * 1e3, 3), "samples_s": round(samples), "warm_s": round(warm_s, 1),
              "checksum": round(checksum, 4), "params_M": round(sum(p.numel() for p in module.parameters()) / 1e6, 1)}), flush=True)
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

V = []
if world == 1:
    V += [("plain fused", dict(ddp=False, fused=True)), ("plain fused gelu", dict(ddp=False, fused=True)),
          ("plain fused accum2", dict(ddp=False, fused=True, accum=2)), ("plain fused accum4", dict(ddp=False, fused=True, accum=4)),
          ("plain fused again", dict(ddp=False, fused=True))]
else:
    V += [("fused gav b100", dict(fused=True, gav=True, bucket=100)),
          ("fused gav static b100", dict(fused=True, gav=True, static=True, bucket=100)),
          ("fused gav b200", dict(fused=True, gav=True, bucket=200)),
          ("fused gav b400", dict(fused=True, gav=True, bucket=400)),
          ("fused b100", dict(fused=True, bucket=100)),
          ("fused gav b100 bf16", dict(fused=True, gav=True, bucket=100, hook="bf16")),
          ("fused b100 bf16", dict(fused=True, bucket=100, hook="bf16")),
          ("fused gav b100 nosync", dict(fused=True, gav=True, bucket=100, nosync=True)),
          ("overlap gav b25", dict(gav=True, bucket=25, overlap_opt=True)),
          ("overlap gav b50", dict(gav=True, bucket=50, overlap_opt=True)),
          ("overlap gav b100", dict(gav=True, bucket=100, overlap_opt=True)),
          ("overlap gav b50 static", dict(gav=True, bucket=50, static=True, overlap_opt=True)),
          ("overlap gav b50 bf16", dict(gav=True, bucket=50, hook="bf16", overlap_opt=True)),
          ("fused gav b100 accum2", dict(fused=True, gav=True, bucket=100, accum=2)),
          ("fused gav b100 accum4", dict(fused=True, gav=True, bucket=100, accum=4)),
          ("fused gav b100 again", dict(fused=True, gav=True, bucket=100))]
for name, kw in V:
    try:
        run(name, **kw)
    except Exception as e:
        if rank == 0: print("SWEEP " + json.dumps({"world": world, "name": name, "error": repr(e)[:300]}), flush=True)
dist.destroy_process_group()
