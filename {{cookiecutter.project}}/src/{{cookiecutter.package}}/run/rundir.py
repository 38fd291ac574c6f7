"""The run dir: one run at a time, a resume that continues the same experiment, and a directory
that can be written. Checked before anything is written there, in one line each.

RunDirGuard runs as a Hydra callback (configs/train.yaml) in every worker, before Hydra creates
the dir; in a sweep (-m), for each job's dir, as the job starts. The launcher checks what
needs none of a worker's imports before torchrun starts (launch_problem); a resume's checks read
the checkpoint, whose formats only a worker imports.
Global rank 0 holds an exclusive lock on `<run dir>/.lock` for the life of its process: the
kernel drops it when the process ends, however it ends, so a dead run's lock is taken over.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from ..config.changeable import FREE_ON_RESUME
from ..config.error import ConfigError
from ..config.global_batch import KEYS as GLOBAL_BATCH_KEYS
from ..config.global_batch import GlobalBatch, GlobalBatchChanged, accepted, on_resume
from ..config.optimizer import upgraded
from ..config.overrides import dotted
from ..config.registry import chosen, fitting
from ..config.schema import TrainConfig, marked_keys
from ..config.token_files import TOKENIZER, sha256_of
from ..config.validate import check_composed, unrecorded
from ..core.exits import exit_with_error
from ..core.files import write_atomically
from ..core.world import World

LOCK = ".lock"
# A holder on another host (a pod on its way out while its replacement starts) gets this long.
REMOTE_HOLDER_WAIT_S = 120
# Keys (and "group." prefixes) a resume may change: marked FREE_ON_RESUME in the schema.
RESUME_MAY_CHANGE = marked_keys(FREE_ON_RESUME)
_held: dict[Path, int] = {}  # run dir -> the open lock file, for the life of this process


class RunDirError(ConfigError):
    """The run dir cannot be used for this run; the message is the one line to print."""


RUN_KEY = "hydra.run.dir"
SWEEP_KEY = "hydra.sweep.dir"  # a sweep's jobs run in <hydra.sweep.dir>/<hydra.sweep.subdir>


class Place(NamedTuple):
    """How a message names the dir: the key that chose it, and the dir as the user knows it."""

    key: str
    shown: str

    @classmethod
    def run(cls, run_dir: Path) -> Place:
        return cls(RUN_KEY, f"{RUN_KEY}={run_dir}")


def empty(value: object, key: str) -> str | None:
    """An empty dir value would run in the launch directory itself (Hydra reads it as .)."""
    if str(value).strip():
        return None
    return f"{key}='': empty; name a directory, or leave {key} out for a new one under outputs/"


def present(path: Path) -> bool:
    """Path.exists(), False where the name cannot exist (too long: unusable() says so)."""
    try:
        return path.exists()
    except OSError:
        return False


def unusable(run_dir: Path, place: Place | None = None) -> str | None:
    """Why this process cannot create and write the run dir, or None."""
    key, shown = place or Place.run(run_dir)
    if present(run_dir) and not run_dir.is_dir():
        return f"{shown}: is a file, not a directory; choose another {key}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"{shown}: cannot be created ({err.strerror})"
    if not os.access(run_dir, os.W_OK | os.X_OK):
        return f"{shown}: not writable by this user"
    return None


def holder(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / LOCK).read_text())
    except (OSError, ValueError):
        return {}


def busy_message(run_dir: Path, who: dict[str, Any], place: Place | None = None) -> str:
    key, shown = place or Place.run(run_dir)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(who.get("since", 0)))
    return (
        f"{shown}: in use by pid {who.get('pid', '?')} on {who.get('host', '?')} "
        f"since {since}; wait for that run to end, or choose another {key}"
    )


def alive_here(who: dict[str, Any]) -> bool:
    return who.get("host") == socket.gethostname() and Path(f"/proc/{who.get('pid')}").exists()


def acquire(
    run_dir: Path, wait_s: float = REMOTE_HOLDER_WAIT_S, place: Place | None = None
) -> None:
    """Hold the run dir's lock until this process ends (or release()). A holder on this host is
    refused at once; one on another host is waited for up to wait_s."""
    if run_dir in _held:
        return
    try:
        fd = os.open(run_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise RunDirError(lock_unusable(run_dir, err, place)) from None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            who = holder(run_dir)
            if alive_here(who) or time.monotonic() > deadline:
                os.close(fd)
                raise RunDirError(busy_message(run_dir, who, place)) from None
            time.sleep(1)
    me = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": time.time(),
        "command": " ".join(sys.argv)[:300],
    }
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(me).encode(), 0)
    _held[run_dir] = fd


def release(run_dir: Path) -> None:
    """Let go of the lock that acquire() took: a sweep's job that ended, while its sweep goes on."""
    fd = _held.pop(run_dir, None)
    if fd is not None:
        os.close(fd)  # closing the last descriptor drops the flock


def lock_unusable(run_dir: Path, err: OSError, place: Place | None = None) -> str:
    key, shown = place or Place.run(run_dir)
    return (
        f"{shown}: its lock file {LOCK} cannot be opened ({err.strerror}); remove it if no run "
        f"uses that dir, or choose another {key}"
    )


def refuse_if_busy(run_dir: Path) -> None:
    """For the launcher: a run dir that another process holds is refused before torchrun starts."""
    path = run_dir / LOCK
    if not path.exists():
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)  # as acquire() will open it
    except OSError as err:
        raise RunDirError(lock_unusable(run_dir, err)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise RunDirError(busy_message(run_dir, holder(run_dir))) from None
    finally:
        os.close(fd)


def keeps_global_batch(state: dict[str, Any], config: TrainConfig, world: World) -> bool:
    """This launch's batch figures make the checkpoint's global batch: they may differ from its
    config's (another world size) and change nothing the run computes."""
    try:
        saved = GlobalBatch.saved(state)
    except (KeyError, TypeError):
        return False
    now = world.size * config.data.batch_size * config.trainer.grad_accumulation
    return now == saved.samples


def global_batch_problem(
    state: dict[str, Any], saved_config: dict[str, Any], config: TrainConfig, world: World
) -> str | None:
    """A world size that cannot keep the checkpoint's global batch (global_batch.on_resume), as
    a line, or None."""
    try:
        saved = GlobalBatch.saved(state)
    except (KeyError, TypeError):
        return None  # not a checkpoint of this project's: the load says what is wrong
    now = GlobalBatch(world.size, config.data.batch_size, config.trainer.grad_accumulation)
    try:
        on_resume(saved, saved_config, now, accepted(config.trainer.accept_changes))
    except GlobalBatchChanged as err:
        return str(err)
    return None


def changes_on_resume(
    saved: dict[str, Any], config: TrainConfig, keeps_batch: bool = False
) -> list[tuple[str, Any, Any]]:
    """Keys that change what the run computes and differ from the checkpoint's config, less
    those that trainer.accept_changes names; with `keeps_batch`, less the batch figures."""
    now = dotted(OmegaConf.to_container(OmegaConf.structured(config), enum_to_str=True))
    before = dotted(upgraded(saved))  # a checkpoint's from before the optimizer group
    accepted = tuple(
        config.trainer.accept_changes
    )  # keys, or groups (validate.check_accept_changes)
    return [
        (key, before.get(key, "(absent)"), now.get(key, "(absent)"))
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
        and not key.startswith(RESUME_MAY_CHANGE)
        and not (keeps_batch and key in GLOBAL_BATCH_KEYS)
        and not any(key == name or key.startswith(f"{name}.") for name in accepted)
    ]


def resume_problem(
    run_dir: Path, config: TrainConfig, world: World, place: Place | None = None
) -> str | None:
    """A resume whose config would change results, or that would train no step, as one line,
    or None. `world`: the launch that would resume (its size makes the global batch)."""
    from . import checkpoint  # the formats (DCP, DTensor): a worker's, not the launcher's

    key, shown = place or Place.run(run_dir)
    found = checkpoint.newest_readable(run_dir, mmap=True)
    if found is None:
        return None
    path, state = found
    step = checkpoint.step_of(path)
    if config.trainer.max_steps < step:  # the loop would end at once, the run looking resumed
        return (
            f"trainer.max_steps={config.trainer.max_steps} is below step {step} of the "
            f"checkpoint in {run_dir} ({path.name}): raise trainer.max_steps, or choose another "
            f"{key}"
        )
    switched = option_problem(state, config, path, run_dir, place)
    if switched:
        return switched
    tokenizer = tokenizer_problem(run_dir, config)
    if tokenizer:
        return f"{shown} resumes from {path.name}: {tokenizer}, or choose another {key}"
    saved_config = state.get("config", {})
    batch = global_batch_problem(state, saved_config, config, world)
    if batch:
        return f"{shown} resumes from {path.name}: {batch}, or choose another {key}"
    changes = changes_on_resume(saved_config, config, keeps_global_batch(state, config, world))
    if not changes:
        return None
    listed = ", ".join(f"{name} {old!r} -> {new!r}" for name, old, new in changes)
    keys = ",".join(name for name, _, _ in changes)
    return (
        f"{shown} resumes from {path.name}, written with another config: {listed}. "
        f"These change results; to continue anyway add trainer.accept_changes=[{keys}], or choose "
        f"another {key}"
    )


def keep_tokenizer(run_dir: Path, config: TrainConfig) -> None:
    """<run dir>/tokenizer.json: a copy of the tokenizer the data's ids come from (generate reads
    it; a resume is checked against it), written by rank 0 at the start of each launch."""
    source = config.data.tokenizer_file()
    if source is not None:
        write_atomically(run_dir / TOKENIZER, source.read_bytes())


def tokenizer_problem(run_dir: Path, config: TrainConfig) -> str | None:
    """A data folder whose tokenizer is not the one the run trained with, as a line, or None:
    the same ids would mean other text. Re-preparing a folder under the same data.path changes
    no key, so the file is compared, not the config."""
    source, kept = config.data.tokenizer_file(), run_dir / TOKENIZER
    if source is None or not kept.is_file() or accepted_key("data.path", config):
        return None
    try:
        now, then = sha256_of(source), sha256_of(kept)
    except OSError:
        return None  # the config check names what cannot be read
    if now == then:
        return None
    return (
        f"data.path={config.data.path}: its {TOKENIZER} (sha256 {now[:12]}) is not the one the "
        f"run trained with ({kept}, sha256 {then[:12]}), so its ids mean other text; resume with "
        "that data folder, add trainer.accept_changes=[data.path] to train on with this one"
    )


def accepted_key(key: str, config: TrainConfig) -> bool:
    """trainer.accept_changes names the key, or a group above it."""
    return any(key == name or key.startswith(f"{name}.") for name in config.trainer.accept_changes)


def option_problem(
    state: dict[str, Any], config: TrainConfig, path: Path, run_dir: Path, place: Place | None
) -> str | None:
    """A resume under another model or data option than the checkpoint was trained with, as one
    line, or None; trainer.accept_changes naming the group lets it switch. A checkpoint written
    before checkpoints recorded their options is the option whose schema has its keys; one whose
    keys fit several is refused too, as nothing tells which it was."""
    key, shown = place or Place.run(run_dir)
    recorded = state.get("options")
    recorded = recorded if isinstance(recorded, dict) else {}
    saved = state.get("config")
    saved = saved if isinstance(saved, dict) else {}
    accepted = set(config.trainer.accept_changes)
    switched, unknown = [], []
    for group, now in chosen(config).items():
        if group in accepted:
            continue
        if group in recorded:
            before = [recorded[group]]
        else:
            values = saved.get(group)
            fits = fitting(group, values) if isinstance(values, dict) else []
            if len(fits) > 1:
                unknown.append((group, now, values, fits))
            before = [o.name for o in fits]
        if len(before) == 1 and before[0] != now:
            switched.append((group, now, before[0]))
    if switched:
        now = ", ".join(f"{group}={name}" for group, name, _ in switched)
        then = ", ".join(f"{group}={name}" for group, _, name in switched)
        groups = ",".join(group for group, _, _ in switched)
        return (
            f"{now}: the checkpoint in {run_dir} ({path.name}) was trained with {then}; resume "
            f"with {then}, add trainer.accept_changes=[{groups}] to switch, or choose another {key}"
        )
    if unknown:
        group, now, values, fits = unknown[0]
        listed = ", ".join(sorted(map(str, values)))
        return (
            f"{shown} resumes from {path.name}: {unrecorded(group, listed, fits)}; to resume it as "
            f"{group}={now} add trainer.accept_changes=[{group}], or choose another {key}"
        )
    return None


def launch_problem(run_dir: Path, busy: bool = True) -> str | None:
    """What the launcher can tell of the run dir before torchrun starts, without a worker's
    imports: whether it can be made and written, and with `busy`, whether another run holds it.
    A resume's checks need the checkpoint's formats: each launch's rank 0 makes them (guard)."""
    try:
        message = unusable(run_dir)
        if message is None and busy:
            refuse_if_busy(run_dir)
        return message
    except RunDirError as err:
        return str(err)


class RunDirGuard(Callback):
    """Hydra calls this after composing the config: for a run before it creates the run dir; for
    each job of a sweep (-m) as that job starts, in the dir Hydra made for it. A callback is where
    Hydra hands the train command control: a refusal ends the command here, in one line (an
    exception would be Hydra's traceback)."""

    def __init__(self) -> None:
        self.world = World.from_env()
        self.before: dict[Path, bytes] = {}  # a sweep's Hydra files as they were before it

    def on_run_start(self, config: DictConfig, **kwargs: object) -> None:
        try:
            message = empty(config.hydra.run.dir, RUN_KEY)
            if message:
                raise RunDirError(message)
            run_dir = Path(config.hydra.run.dir)
            guard(run_dir, config, self.world, Place.run(run_dir))
        except ConfigError as err:
            exit_with_error(f"config error: {err}", self.world)

    def on_multirun_start(self, config: DictConfig, **kwargs: object) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        # Hydra's launcher creates the sweep dir next: a file there would be a traceback.
        message = empty(config.hydra.sweep.dir, SWEEP_KEY) or unusable(
            sweep_dir, Place(SWEEP_KEY, f"{SWEEP_KEY}={sweep_dir}")
        )
        if message:
            exit_with_error(f"config error: {message}", self.world)
        # Hydra writes each job's .hydra/ (and the sweep's multirun.yaml) before on_job_start: a
        # job refused there puts back what an earlier sweep left.
        for pattern in ("multirun.yaml", "*/.hydra/*", "*/*/.hydra/*"):
            for path in sweep_dir.glob(pattern):
                with contextlib.suppress(OSError):
                    self.before[path.resolve()] = path.read_bytes()

    def on_job_start(self, config: DictConfig, **kwargs: object) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:  # a run's own dir was guarded on_run_start
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        sweep = f"{SWEEP_KEY}={config.hydra.sweep.dir}"
        place = Place(SWEEP_KEY, f"{sweep} job {config.hydra.job.num} ({job_dir})")
        try:
            guard(job_dir, config, self.world, place)
        except ConfigError as err:
            self.put_back(config)
            exit_with_error(f"config error: {err}", self.world)

    def on_job_end(self, config: DictConfig, **kwargs: object) -> None:
        if config.hydra.mode == RunMode.MULTIRUN:  # the sweep's next job has a dir of its own
            release(Path(config.hydra.runtime.output_dir))

    def put_back(self, config: DictConfig) -> None:
        """The Hydra files of a refused job's dir as they were; the sweep's multirun.yaml too."""
        written = [Path(config.hydra.sweep.dir) / "multirun.yaml"]
        if config.hydra.output_subdir is not None:
            hydra_dir = Path(config.hydra.runtime.output_dir) / config.hydra.output_subdir
            written += [hydra_dir / name for name in HYDRA_FILES]
        for path in written:
            old = self.before.get(path.resolve())
            with contextlib.suppress(OSError):
                if old is not None:
                    path.write_bytes(old)
                elif path.name != "multirun.yaml":  # this sweep's own: its other jobs need it
                    path.unlink(missing_ok=True)


HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra's run_job saves


def guard(run_dir: Path, config: DictConfig, world: World, place: Place) -> None:
    """Every rank: the dir can be written. Global rank 0: the lock, and the resume check; each
    other node's local rank 0: the resume check too, so that every node's launcher ends with the
    line (exit 2) rather than with a rendezvous that rank 0 left. A refusal raises RunDirError
    (or the config's ConfigError), its message the line to print."""
    message = unusable(run_dir, place)  # every rank: Hydra creates the dir in each
    if message is None and world.main:
        holder_before = lock_text(run_dir)
        acquire(run_dir, place=place)
        message = resume_problem(run_dir, check_composed(config, world), world, place)
        if message:  # a refused resume leaves the run dir as it was: its last holder named
            put_back_holder(run_dir, holder_before)
    elif message is None and world.local_rank == 0:
        message = resume_problem(run_dir, check_composed(config, world), world, place)
    if message:
        raise RunDirError(message)


def lock_text(run_dir: Path) -> bytes | None:
    try:
        return (run_dir / LOCK).read_bytes()
    except OSError:
        return None


def put_back_holder(run_dir: Path, before: bytes | None) -> None:
    """The lock file as it was before acquire(), written while the lock is still held, then let
    go: no other run can take it in between and find its own holder overwritten."""
    fd = _held[run_dir]
    with contextlib.suppress(OSError):
        if before is None:  # none was there: a run that takes the lock now makes its own
            (run_dir / LOCK).unlink()
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, before, 0)
    release(run_dir)
