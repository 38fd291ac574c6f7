#!/usr/bin/env bash
# The generated project's recovery tests (CPU, gloo: no GPU needed) on the GPU machine's torch,
# the image's (2.11), not the test environment's 2.13: the launcher relies on torchrun's agent
# internals (worker_exits.Agent) and on the store connections torch opens (store_liveness.py),
# which a torch release may change. TESTS picks the pytest node ids or -k expression. Logs in $OUT.
#   scripts/fetch-gpu-wheels.sh ruamel.yaml==0.19.1   # once, here
#   device run (kind nvidia-h200, carry .whl):  bash scripts/gpu-image-torch.sh
set -uo pipefail
source "$(dirname "$0")/gpu-setup.sh"
cd "$project"
bin=$(mktemp -d)
printf '#!/bin/sh\nexec python3 -m ddp_project.launch "$@"\n' >"$bin/ddp-project" && chmod +x "$bin/ddp-project"
export PATH=$bin:$PATH CUDA_VISIBLE_DEVICES=
if ip netns add gpu-image-probe 2>/dev/null; then ip netns del gpu-image-probe; echo "network namespaces: yes"
else echo "network namespaces: no (the silent-loss tests skip)"; fi | tee "$OUT/netns.txt"
# shellcheck disable=SC2086  # TESTS is pytest's arguments
python3 -m pytest -p no:cacheprovider -n "${WORKERS:-6}" -rA --timeout 900 \
  ${TESTS:-tests/test_store_liveness.py tests/test_restarts.py tests/test_multinode.py} 2>&1 \
  | grep -v '^frame #' | tee "$OUT/tests.log" | tail -60
echo "GPU-RESULT pytest exit ${PIPESTATUS[0]}"
