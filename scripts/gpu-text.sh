#!/usr/bin/env bash
# Real text on the GPU: a corpus of the Python standard library's source (its UTF-8 files, at most
# 40 MB; offline on any machine) made into a data folder by the project's own data command, then
# gpt2_small trained on it through scripts/gpu-mfu.sh, DDP and FSDP2 interleaved round by round.
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-text.sh [NAME:OVERRIDES ...]
# Without arguments: "ddp" (the defaults) and "fsdp2" (dist.strategy=fsdp2, DCP checkpoints).
# The data folder is $TEXT_DATA (default /tmp/text-data), kept when it is there already.
set -euo pipefail
scripts=$(cd "$(dirname "$0")" && pwd)
source "$scripts/gpu-setup.sh"
data=${TEXT_DATA:-/tmp/text-data}
if [[ ! -f $data/meta.json ]]; then
  corpus=$(mktemp -d)
  python3 - "$corpus" <<'PY'
import shutil, sys, sysconfig
from pathlib import Path
stdlib, out = Path(sysconfig.get_paths()["stdlib"]), Path(sys.argv[1])
kept = 0
for path in sorted(stdlib.rglob("*.py")):
    if {"site-packages", "dist-packages"} & set(path.parts) or kept > 40e6:
        continue
    try:
        raw = path.read_bytes()
        raw.decode("utf-8")
    except (OSError, UnicodeDecodeError):
        continue
    if b"\0" in raw or not raw.strip():
        continue
    target = out / path.relative_to(stdlib)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, target)
    kept += len(raw)
print(f"corpus: {kept / 1e6:.1f} MB of {stdlib}'s source")
PY
  /usr/bin/time -f "data command: %e s, %M KiB" python3 -m ddp_project.prepare "$corpus" "$data" 2>&1 | tee "$OUT/data.log"
fi
cat "$data/meta.json" >"$OUT/meta.json"
if [[ $# == 0 ]]; then
  set -- "ddp:experiment=gpt2_small data.path=$data" \
    "fsdp2:experiment=gpt2_small data.path=$data dist.strategy=fsdp2 trainer.checkpoint_format=dcp"
fi
bash "$scripts/gpu-mfu.sh" "$@"
