"""The NCCL decision: config, node facts and the inherited environment in; the env to write out.

Pure functions, standard library only, so every rule is testable without GPUs.

Precedence, lowest first:
  1. NCCL's own default (the variable stays unset), or our flight-recorder default;
  2. the `auto` profile's choice, from the node facts;
  3. a variable already in the environment (e.g. the Kubernetes Job's env block);
  4. an explicit, non-null config field (`nccl.p2p_disable=true`, `nccl.env.NCCL_ALGO=Ring`,
     `dist.async_error_handling=2`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

# Config field -> the NCCL variable it sets. One field, one variable.
FIELD_VARS = {
    "p2p_disable": "NCCL_P2P_DISABLE",
    "p2p_level": "NCCL_P2P_LEVEL",
    "ib_disable": "NCCL_IB_DISABLE",
    "ib_hca": "NCCL_IB_HCA",
    "ib_gid_index": "NCCL_IB_GID_INDEX",
    "shm_disable": "NCCL_SHM_DISABLE",
    "socket_ifname": "NCCL_SOCKET_IFNAME",
    "debug": "NCCL_DEBUG",
    "debug_subsys": "NCCL_DEBUG_SUBSYS",
}
# The fields that hold text; NCCL reads the last three (and many nccl.env values) as comma lists.
TEXT_FIELDS = ("p2p_level", "ib_hca", "socket_ifname", "debug_subsys")
P2P_LEVELS = ("LOC", "NVL", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5")
MAX_VALUE_CHARS = 4096  # an environment variable: Linux refuses one over 128 KiB at exec
NCCL_VAR = re.compile(r"NCCL_[A-Z0-9_]+")
# What the report shows from the environment, and what nccl.env may set: GLOO_* too, since the
# gloo backend (CPU runs, and torch's CPU-side groups) reads GLOO_SOCKET_IFNAME as NCCL
# reads its own.
TRACKED_VAR = re.compile(r"(TORCH_)?NCCL_[A-Z0-9_]+|GLOO_[A-Z0-9_]+")
# torchrun puts these into every worker's environment unless its own environment has them.
LAUNCHER_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
BROKEN = ("failed", "hang")  # outcomes of the peer-copy test that mean "no P2P on this pair"
MIB = 2**20


@dataclass(frozen=True)
class NodeFacts:
    """What the probe saw on this node. GPU indices are CUDA's, as torch numbers them."""

    gpu_count: int
    nvlink_pairs: frozenset[tuple[int, int]]  # (i, j), i < j, joined by NVLink
    ib_active_ports: int
    world_size: int
    local_world_size: int
    shm_bytes: int | None = None  # size of /dev/shm; None where it could not be read
    # Peer-copy test of each PCIe-only pair: "ok", "failed" or "hang"; NVLink pairs are not tested.
    p2p_tests: Mapping[tuple[int, int], str] = field(default_factory=dict)
    probe_s: float = 0.0

    @property
    def multi_node(self) -> bool:
        return self.world_size > self.local_world_size

    @property
    def pcie_pairs(self) -> list[tuple[int, int]]:
        pairs = [(i, j) for i in range(self.gpu_count) for j in range(i + 1, self.gpu_count)]
        return [pair for pair in pairs if pair not in self.nvlink_pairs]

    def to_json(self) -> str:
        data = asdict(self)
        data["nvlink_pairs"] = sorted(self.nvlink_pairs)
        data["p2p_tests"] = [[i, j, result] for (i, j), result in sorted(self.p2p_tests.items())]
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> NodeFacts:
        data = json.loads(text)
        data["nvlink_pairs"] = frozenset(tuple(pair) for pair in data["nvlink_pairs"])
        data["p2p_tests"] = {(i, j): result for i, j, result in data["p2p_tests"]}
        return cls(**data)

    def summary(self) -> str:
        links = ", ".join(f"GPU{i}-GPU{j} NVLink" for i, j in sorted(self.nvlink_pairs))
        tests = ", ".join(
            f"GPU{i}-GPU{j} PCIe P2P {r}" for (i, j), r in sorted(self.p2p_tests.items())
        )
        shm = f"{self.shm_bytes / MIB:.0f} MiB" if self.shm_bytes is not None else "unknown"
        nodes = "several nodes" if self.multi_node else "single node"
        parts = [
            f"{self.gpu_count} GPU(s)",
            links,
            tests,
            f"{self.ib_active_ports} active IB port(s)",
        ]
        parts += [f"/dev/shm {shm}", nodes, f"probe took {self.probe_s:.2f} s"]
        return "; ".join(part for part in parts if part)


@dataclass(frozen=True)
class AutoChoice:
    """One rule's outcome: a value for `var`, or None to leave it to NCCL, and the evidence."""

    var: str
    value: str | None
    reason: str


@dataclass(frozen=True)
class Setting:
    value: str | None  # None: unset, NCCL's default applies
    source: str


@dataclass(frozen=True)
class Decision:
    settings: dict[str, Setting]  # every variable we set, saw or reasoned about
    warnings: tuple[str, ...]

    @property
    def env(self) -> dict[str, str]:
        """The variables to write into os.environ before init_process_group."""
        return {var: s.value for var, s in self.settings.items() if s.value is not None}

    def report(self, only_nccl: bool = False) -> str:
        shown = {v: s for v, s in self.settings.items() if not only_nccl or NCCL_VAR.fullmatch(v)}
        width = max((len(var) for var in shown), default=0)
        lines = [
            f"  {var:<{width}} = {s.value if s.value is not None else '(unset)':<7} {s.source}"
            for var, s in sorted(shown.items())
        ]
        return "\n".join(lines) if lines else "  (no NCCL variables set: NCCL decides everything)"


def env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, Enum):
        return value.name
    return str(value)


def config_env(nccl_cfg: Any) -> dict[str, tuple[str, str]]:
    """Explicit config values as {var: (value, source)}. Fields left null are not listed."""
    explicit = {}
    for name, var in FIELD_VARS.items():
        value = getattr(nccl_cfg, name)
        if value is not None:
            explicit[var] = (env_value(value), f"config nccl.{name}")
    for var, value in nccl_cfg.env.items():
        if value is not None:
            explicit[var] = (env_value(value), f"config nccl.env.{var}")
    return explicit


def value_error(key: str, value: Any) -> str | None:
    """What is wrong with a text value for an environment variable, or None."""
    text = str(value)
    if not text:
        return f"{key}: empty; give a value, or null to leave the variable to NCCL"
    if any(ord(char) < 32 or ord(char) == 127 for char in text):
        return f"{key}={text!r}: holds a control character (a newline?); give one line"
    if text != text.strip():
        return f"{key}={text!r}: spaces at its ends, which NCCL would read as part of it"
    if len(text) > MAX_VALUE_CHARS:
        return (
            f"{key}: {len(text)} characters; "
            f"an environment variable here takes at most {MAX_VALUE_CHARS}"
        )
    return None


def config_errors(nccl_cfg: Any) -> list[str]:
    """Problems that typing alone cannot catch, one line each, naming the key."""
    errors = []
    field_of = {var: f"nccl.{name}" for name, var in FIELD_VARS.items()}
    field_of["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "dist.async_error_handling"
    for name in TEXT_FIELDS:
        value = getattr(nccl_cfg, name)
        if value is not None:
            errors.append(value_error(f"nccl.{name}", value))
    index = nccl_cfg.ib_gid_index
    if index is not None and not -1 <= index <= 255:
        errors.append(
            f"nccl.ib_gid_index={index}: must be -1 (NCCL picks) to 255 (NCCL_IB_GID_INDEX)"
        )
    level = nccl_cfg.p2p_level
    if level is not None and str(level) not in P2P_LEVELS:
        errors.append(
            f"nccl.p2p_level={level}: must be one of {', '.join(P2P_LEVELS[:6])} (NCCL_P2P_LEVEL)"
        )
    for var, value in nccl_cfg.env.items():
        if not TRACKED_VAR.fullmatch(var):
            errors.append(
                f"nccl.env.{var}: keys must be NCCL_*, TORCH_NCCL_* or GLOO_* variable names "
                "(A-Z, 0-9, _); other variables: deploy.env, or deploy.secret_env for a secret"
            )
        elif var in field_of:
            errors.append(f"nccl.env.{var}: set it with {field_of[var]} instead")
        elif value is None:
            continue  # left to NCCL: unsets what a profile sets
        elif str(value).lower() in ("true", "false"):
            errors.append(
                f"nccl.env.{var}={value}: NCCL reads a number here, not a bool; write 1 or 0"
            )
        else:
            errors.append(value_error(f"nccl.env.{var}", value))
    return [error for error in errors if error]


def pairs_text(pairs: list[tuple[int, int]]) -> str:
    return ", ".join(f"GPU{i}-GPU{j}" for i, j in pairs)


def p2p_choices(facts: NodeFacts) -> list[AutoChoice]:
    """NVLink pairs keep P2P. A PCIe pair whose peer copy failed or hung loses it: all of P2P
    where no NVLink exists, only the PCIe path (NCCL_P2P_LEVEL=NVL) where some pairs have it."""
    if facts.gpu_count < 2 or facts.local_world_size < 2:
        return []
    nvlink = sorted(facts.nvlink_pairs)
    tested = sorted(facts.p2p_tests.items())
    broken = [f"GPU{i}-GPU{j} {result}" for (i, j), result in tested if result in BROKEN]
    working = [pair for pair, result in tested if result == "ok"]
    evidence = []
    if nvlink:
        evidence.append(f"NVLink between {pairs_text(nvlink)}")
    if working:
        evidence.append(f"PCIe P2P copy verified between {pairs_text(working)}")
    if not broken:
        return [AutoChoice("NCCL_P2P_DISABLE", None, "auto: " + "; ".join(evidence) + ", P2P kept")]
    evidence.append("PCIe P2P copy " + ", ".join(broken))
    if nvlink:
        return [
            AutoChoice(
                "NCCL_P2P_LEVEL", "NVL", "auto: " + "; ".join(evidence) + ", P2P over NVLink only"
            )
        ]
    return [AutoChoice("NCCL_P2P_DISABLE", "1", "auto: " + "; ".join(evidence) + ", P2P off")]


def ib_choice(facts: NodeFacts) -> AutoChoice:
    if not facts.multi_node:
        return AutoChoice("NCCL_IB_DISABLE", "1", "auto: single node, InfiniBand unused")
    if facts.ib_active_ports == 0:
        return AutoChoice("NCCL_IB_DISABLE", "1", "auto: several nodes, no active InfiniBand port")
    return AutoChoice(
        "NCCL_IB_DISABLE", None, f"auto: several nodes, {facts.ib_active_ports} active IB port(s)"
    )


def auto_choices(facts: NodeFacts) -> list[AutoChoice]:
    """The `auto` profile's rules, each with the evidence behind it."""
    return [*p2p_choices(facts), ib_choice(facts)]


def flight_recorder_env(trace_prefix: str, torch_version: str) -> dict[str, str]:
    """Flight-recorder defaults: each rank keeps its last collectives and dumps them to
    trace_prefix<rank> when one times out. PyTorch before 2.11 names the buffer
    TORCH_NCCL_TRACE_BUFFER_SIZE."""
    major_minor = tuple(int(part) for part in re.findall(r"\d+", torch_version)[:2])
    buffer_var = (
        "TORCH_FR_BUFFER_SIZE" if major_minor >= (2, 11) else "TORCH_NCCL_TRACE_BUFFER_SIZE"
    )
    return {
        buffer_var: "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": trace_prefix,
    }


def explicit_settings(async_error_handling: int | None) -> dict[str, tuple[str, str]]:
    """Settings of the dist group that become NCCL-side variables, for decide()'s `explicit`."""
    if async_error_handling is None:
        return {}
    value = (str(async_error_handling), "config dist.async_error_handling")
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": value}


def decide(
    nccl_cfg: Any,
    facts: NodeFacts | None,
    inherited: Mapping[str, str],
    defaults: Mapping[str, str] | None = None,
    explicit: Mapping[str, tuple[str, str]] | None = None,
) -> Decision:
    """The environment for one process. Identical inputs give every rank the same env.

    `defaults` sit below the environment; `explicit` ({var: (value, source)}) ranks with the
    config's own fields, above it.
    """
    settings = {
        var: Setting(value, "flight-recorder default") for var, value in (defaults or {}).items()
    }
    warnings = []
    if nccl_cfg.auto and facts is not None:
        for choice in auto_choices(facts):
            settings[choice.var] = Setting(choice.value, choice.reason)
    for var, value in inherited.items():
        if TRACKED_VAR.fullmatch(var):
            earlier = settings.get(var)
            overruled = (
                f" (over {earlier.source} -> {earlier.value})"
                if earlier and earlier.value != value
                else ""
            )
            settings[var] = Setting(value, f"environment{overruled}")
    for var, (value, source) in {**config_env(nccl_cfg), **(explicit or {})}.items():
        before = inherited.get(var)
        if before is not None and before != value:
            if LAUNCHER_DEFAULTS.get(var) == before:
                source += f" (over torchrun's default {before})"
            else:
                warnings.append(
                    f"{source}={value} overrides {var}={before} from the environment; "
                    f"{var}={value} is in force"
                )
        settings[var] = Setting(value, source)
    return Decision(settings, tuple(warnings))


def shm_needed_bytes(local_world_size: int, env: Mapping[str, str]) -> int:
    """What NCCL's SHM transport maps in /dev/shm: per rank and channel, a send and a receive
    buffer of NCCL_BUFFSIZE (4 MiB by default). We budget 16 channels."""
    buffsize = int(env.get("NCCL_BUFFSIZE", 4 * MIB))
    return local_world_size * 16 * 2 * buffsize


def uses_shm(facts: NodeFacts, env: Mapping[str, str]) -> bool:
    """Local ranks talk over SHM where P2P is off for some pair and SHM is not disabled."""
    if facts.local_world_size < 2 or env.get("NCCL_SHM_DISABLE") == "1":
        return False
    if env.get("NCCL_P2P_DISABLE") == "1":
        return True
    return env.get("NCCL_P2P_LEVEL") in ("NVL", "0", "LOC") and bool(facts.pcie_pairs)


def shm_error(facts: NodeFacts, env: Mapping[str, str]) -> str | None:
    """A one-paragraph error when /dev/shm cannot hold the SHM transport that will be used."""
    if facts.shm_bytes is None or not uses_shm(facts, env):
        return None
    needed = shm_needed_bytes(facts.local_world_size, env)
    if facts.shm_bytes >= needed:
        return None
    return (
        f"/dev/shm is {facts.shm_bytes / MIB:.0f} MiB, but NCCL's shared-memory transport (used "
        f"here because P2P is off) needs about {needed / MIB:.0f} MiB for {facts.local_world_size} "
        "local ranks. On Kubernetes, mount an emptyDir with medium: Memory at /dev/shm "
        "(k8s/job.yaml does; raise its sizeLimit); with docker, pass --shm-size=1g or --ipc=host."
    )
