"""Issue 24 on one GPU: validation's cost and figures against evaluate's on the same checkpoint,
best.pt, the schedule in the rows, and a SIGTERM during a validation.
    python3 scripts/gpu-val.py WORKDIR   # after scripts/gpu-setup.sh (bash scripts/gpu-val.sh); logs in $OUT
"""

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

OUT, PKG = Path(os.environ["OUT"]), "ddp_project"
work = Path(sys.argv[1])


def launch(run_dir, *overrides):
    return [
        sys.executable,
        "-m",
        f"{PKG}.launch",
        "train",
        "--nproc-per-node",
        "1",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]


# 1. gpt2_small (compiled, bf16, cosine): 600 steps, a validation every 50, checkpoints at 300, 600
run = work / "gpt2"
started = time.monotonic()
done = subprocess.run(
    launch(
        run,
        "experiment=gpt2_small",
        "trainer.max_steps=600",
        "trainer.val_every=50",
        "trainer.log_every=50",
        "trainer.checkpoint_every=300",
    ),
    capture_output=True,
    text=True,
    cwd=work,
)
print(f"GPU-RESULT train exit {done.returncode} in {time.monotonic() - started:.0f} s")
(OUT / "gpt2-stderr.txt").write_text(done.stderr[-20000:])
for name in ("train.log", "metrics.jsonl", "metrics.csv"):
    if (run / name).exists():
        shutil.copy(run / name, OUT / f"gpt2-{name}")
rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
for r in rows:
    print(
        f"step {r['step']:4d} lr {r['lr']:.3g} loss {r['loss']:.4f} val_loss {r['val_loss']} "
        f"val_acc {r['val_accuracy']} val_time_s {r['val_time_s']} step_ms {r['step_time_ms']:.1f}"
    )
val_times = [r["val_time_s"] for r in rows if r["val_time_s"] is not None]
steady = [r["step_time_ms"] for r in rows[1:]]  # the first window holds the compile
step_ms = statistics.median(steady)
median_val = statistics.median(val_times[1:])  # the first validation's kernels warm up
print(
    f"GPU-RESULT validation: median {median_val:.3f} s (range {min(val_times[1:]):.3f}-{max(val_times[1:]):.3f}, "
    f"first {val_times[0]:.3f}) over {len(val_times)} validations; median step {step_ms:.1f} ms "
    f"(range {min(steady):.1f}-{max(steady):.1f}); at val_every=50 validation adds "
    f"{100 * median_val / (50 * step_ms / 1000):.1f}% to the steps' time, "
    f"at 100 {100 * median_val / (100 * step_ms / 1000):.1f}%"
)
print("GPU-RESULT recompile lines:", sum("recompil" in line for line in (run / "train.log").read_text().splitlines()))
by_step = {r["step"]: r for r in rows}
for ckpt, step in ((run / "checkpoints" / "step_000000600.pt", 600), (run / "checkpoints" / "best.pt", None)):
    ev = subprocess.run(
        [sys.executable, "-m", f"{PKG}.evaluate", f"ckpt={ckpt}"], capture_output=True, text=True, cwd=work
    )
    print("evaluate", ckpt.name, "exit", ev.returncode, ev.stdout.strip()[-300:], ev.stderr.strip()[-500:])
    result = json.loads((run / "eval" / f"{ckpt.stem}.json").read_text())
    step = result["step"]
    row = by_step[step]
    print(
        f"GPU-RESULT {ckpt.name} (step {step}): evaluate loss {result['loss']!r} acc {result['accuracy']!r}; "
        f"validation at step {step}: {row['val_loss']!r} {row['val_accuracy']!r}; equal: "
        f"{(result['loss'], result['accuracy']) == (row['val_loss'], row['val_accuracy'])}"
    )
best_row = min((r for r in rows if r["val_loss"] is not None), key=lambda r: r["val_loss"])
print("GPU-RESULT lowest val_loss at step", best_row["step"])
print("checkpoints:", sorted(p.name for p in (run / "checkpoints").iterdir()))
shutil.rmtree(run / "checkpoints", ignore_errors=True)

# 2. A SIGTERM during a validation: gpt2_small with 4096 held-out sequences (seconds to score)
#    after every step; the signal to the launcher (the kubelet's PID 1) 2 s after the first step.
run = work / "stop"
process = subprocess.Popen(
    launch(
        run,
        "experiment=gpt2_small",
        "data.num_samples=40960",
        "trainer.val_every=1",
        "trainer.max_steps=1000",
        "trainer.checkpoint_every=1000",
    ),
    stdout=subprocess.PIPE,
    stderr=subprocess.STDOUT,
    text=True,
    cwd=work,
    start_new_session=True,
)
lines, signalled = [], None
try:
    for line in process.stdout:
        lines.append(line)
        if signalled is None and "the first step took" in line:
            time.sleep(2)
            signalled = time.monotonic()
            os.kill(process.pid, signal.SIGTERM)
    code = process.wait(timeout=120)
finally:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
(OUT / "stop-output.txt").write_text("".join(lines))
print(f"GPU-RESULT SIGTERM during validation: exit {code} in {time.monotonic() - signalled:.2f} s after the signal")
print("".join(line for line in lines if "stopped" in line or "checkpoint" in line or "SIGTERM" in line)[-2000:])
kept = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").exists() else None
print("checkpoints:", kept)
