"""One fresh process's first compiled step of gpt2_small (regional compilation, the compiled
loss, bf16 autocast, fused AdamW: the template's own pieces), from one of three caches:
  cold  TORCHINDUCTOR_CACHE_DIR empty; afterwards PyTorch's portable cache
        (torch.compiler.save_cache_artifacts) is written to BLOB
  dir   TORCHINDUCTOR_CACHE_DIR as the cold process left it (the cache beside the runs)
  blob  TORCHINDUCTOR_CACHE_DIR empty; BLOB loaded first (load_cache_artifacts), its time counted
Prints one JSON line. scripts/gpu-portable-cache.sh runs it.
    python3 gpu-portable-cache.py MODE BLOB
"""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

began = time.perf_counter()
import torch  # noqa: E402
from ddp_project.model import Gpt  # noqa: E402
from ddp_project.run import compilation  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

mode, blob = sys.argv[1], Path(sys.argv[2])
imported = time.perf_counter()
loaded_s = 0.0
if mode == "blob":
    started = time.perf_counter()
    torch.compiler.load_cache_artifacts(blob.read_bytes())
    loaded_s = time.perf_counter() - started
device = torch.device("cuda")
torch.manual_seed(0)
with device:
    model = Gpt(
        SimpleNamespace(n_layer=12, n_head=12, d_model=768),
        SimpleNamespace(seq_len=1024, vocab_size=50304),
    )
forward = compilation.compiled_forward(model, model)
loss_of = compilation.loss_function(True)
optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, fused=True)
tokens = torch.randint(0, 50304, (32, 1025), device=device)
inputs, labels = tokens[:, :-1], tokens[:, 1:]


def step() -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = loss_of(forward(inputs), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


started = time.perf_counter()
step()
first_s = time.perf_counter() - started
steady = []
for _ in range(20):
    started = time.perf_counter()
    step()
    steady.append(time.perf_counter() - started)
saved_bytes = 0
if mode == "cold":
    artifacts = torch.compiler.save_cache_artifacts()
    if artifacts is not None:
        blob.write_bytes(artifacts[0])
        saved_bytes = len(artifacts[0])
print(
    json.dumps(
        {
            "mode": mode,
            "import_s": imported - began,
            "load_s": loaded_s,
            "first_step_s": first_s,
            "load_and_first_step_s": loaded_s + first_s,
            "steady_ms": sorted(steady)[len(steady) // 2] * 1e3,
            "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
            "blob_bytes": saved_bytes,
            "since_start_s": time.perf_counter() - began,
        }
    ),
    flush=True,
)
