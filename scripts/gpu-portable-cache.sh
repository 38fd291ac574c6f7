#!/usr/bin/env bash
# The cache beside the runs (a directory inductor reads) against PyTorch's portable cache (one
# blob, torch.compiler.save_cache_artifacts / load_cache_artifacts), for a fresh process's first
# compiled step of gpt2_small: cold, then the directory and the blob interleaved, ROUNDS (2)
# rounds. Each process a fresh node: /tmp's caches emptied. Rows in $OUT/portable.jsonl.
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-portable-cache.sh
set -uo pipefail
scripts=$(cd "$(dirname "$0")" && pwd)
source "$scripts/gpu-setup.sh"
cd "$work"
dir=$work/dir-cache blob=$work/portable.bin
: >"$OUT/portable.jsonl"
fresh() { rm -rf /tmp/torchinductor_"$(id -un)" "$HOME/.triton/cache"; }
one() {  # mode cache-dir
  fresh
  TORCHINDUCTOR_CACHE_DIR=$2 timeout 300 python3 "$scripts/gpu-portable-cache.py" "$1" "$blob" \
    | tee -a "$OUT/portable.jsonl"
}
one cold "$dir"
for round in $(seq "${ROUNDS:-2}"); do
  order=(dir blob); ((round % 2 == 0)) && order=(blob dir)
  for mode in "${order[@]}"; do
    empty=$work/empty-$mode-$round
    [[ $mode == dir ]] && one dir "$dir" || one blob "$empty"
  done
done
python3 - "$OUT/portable.jsonl" <<'PY' | tee "$OUT/portable.log"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for mode in ("cold", "dir", "blob"):
    got = [r for r in rows if r["mode"] == mode]
    if got:
        t = [r["load_and_first_step_s"] for r in got]
        print(f"{mode:5} load+first step median {statistics.median(t):.2f} s ({min(t):.2f}-{max(t):.2f}), "
              f"steady {statistics.median(r['steady_ms'] for r in got):.1f} ms, {got[0]['inductor']}")
PY
