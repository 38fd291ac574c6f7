"""Stop signals on a GPU node, as a pod gets them: a fresh run, then after one and two resumes,
and with overrides that compile the model (experiment=gpt2_small), one more while the first step
after a resume compiles: nothing new to save, so the process must end at once, not after the
compile (issue 22).

    python3 scripts/gpu-stop.py PACKAGE [NPROC [OVERRIDES...]]   # after scripts/gpu-setup.sh

Each launch is `<project> train` (python -m PACKAGE.launch train) into one run dir. The first two
stops are SIGTERM to the launcher alone (the kubelet signals PID 1), sent at the first step line
after the start or the resume; the third is SIGINT to the process group (Ctrl-C). Prints, per
stop: seconds from the signal to the launcher's exit, its exit code, the step it names and the
newest checkpoint's step; writes them as JSON to $OUT/gpu-stop.json.
"""

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STOPPED = re.compile(r"(SIGTERM|SIGINT): stopped at step (\d+)")


def stop_once(package: str, nproc: int, run_dir: Path, signum: int, group: bool, after: str,
              overrides: list[str], compiling: bool = False) -> dict:  # fmt: skip
    """Signal at the first step line after `after`; `compiling`: 3 s after `after` itself."""
    command = [sys.executable, "-m", f"{package}.launch", "train", "--nproc-per-node", str(nproc),
               f"hydra.run.dir={run_dir}", "trainer.max_steps=100000000", "trainer.log_every=50",
               "trainer.checkpoint_every=1000000", *overrides]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
    lines, seen, signalled = [], False, None
    try:
        for line in process.stdout:
            lines.append(line)
            seen = seen or after in line
            if signalled is None and seen and (compiling or "loss" in line):
                if compiling:
                    time.sleep(3)  # the first step is compiling
                signalled = time.monotonic()
                (os.killpg if group else os.kill)(process.pid, signum)
        code = process.wait(timeout=120)
        seconds = time.monotonic() - signalled if signalled else None
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    output = "".join(lines)
    named = STOPPED.findall(output)
    newest = sorted((run_dir / "checkpoints").glob("step_*.pt"))
    return {
        "signal": signal.Signals(signum).name,
        "to": "process group" if group else "launcher",
        "seconds": None if seconds is None else round(seconds, 2),
        "exit": code,
        "stopped_at": int(named[-1][1]) if named else None,
        "newest_checkpoint": int(newest[-1].stem.split("_")[1]) if newest else None,
        "nothing_to_save": "stopped before the first step, nothing new to save" in output,
        "compiled": "torch.compile: the first step took" in output,  # the first step ended
        "last_lines": output.strip().splitlines()[-3:],
    }


def main() -> int:
    package, nproc = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1
    overrides = sys.argv[3:]
    run_dir = Path(tempfile.mkdtemp()) / "run"
    results = [
        stop_once(package, nproc, run_dir, signal.SIGTERM, False, "gate all-reduce passed", overrides),
        stop_once(package, nproc, run_dir, signal.SIGTERM, False, "resumed from", overrides),
        stop_once(package, nproc, run_dir, signal.SIGINT, True, "resumed from", overrides),
    ]
    during_compile = None
    if any("gpt2_small" in o or "trainer.compile=true" in o for o in overrides):
        during_compile = stop_once(package, nproc, run_dir, signal.SIGTERM, False, "resumed from",
                                   overrides, compiling=True)  # fmt: skip
    for resumes, row in enumerate(results[:3]):
        print(f"GPU-RESULT stop after {resumes} resume(s): {row['signal']} to the {row['to']}: "
              f"exit {row['exit']} in {row['seconds']} s, stopped at step {row['stopped_at']}, "
              f"newest checkpoint {row['newest_checkpoint']}")  # fmt: skip
    ok = all(r["exit"] in (130, 143) and r["seconds"] is not None and r["seconds"] < 5
             and r["stopped_at"] == r["newest_checkpoint"] for r in results)  # fmt: skip
    if during_compile:
        row = during_compile
        print(f"GPU-RESULT stop while the first step compiles: exit {row['exit']} in {row['seconds']} s, "
              f"nothing new to save said: {row['nothing_to_save']}, first step done: {row['compiled']}, "
              f"newest checkpoint {row['newest_checkpoint']}")  # fmt: skip
        ok = ok and row["exit"] == 143 and row["seconds"] is not None and row["seconds"] < 5
        # Ended inside the first step: its compile never finished, nothing was saved after it.
        ok = ok and row["nothing_to_save"] and not row["compiled"]
        ok = ok and row["newest_checkpoint"] == results[-1]["newest_checkpoint"]
        results.append(row)
    (Path(os.environ.get("OUT", "/tmp")) / "gpu-stop.json").write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
